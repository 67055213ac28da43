package e2e_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/typeurl/v2"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// host is what every e2e node has, whatever runs its kubelet (e2e-node, or a real k3s): a temp
// dir, a loop-mounted ext4 as containerd's root (the kubelet's imagefs, which dd fills), a
// containerd client with the CRI beside it, and the node's process, whose exit ends every wait.
type host struct {
	t       *testing.T
	ctx     context.Context
	dir     string
	imagefs string // mount point of the loop device
	loop    string // the loop device
	log     string // the node process's log
	client  *containerd.Client
	images  runtimeapi.ImageServiceClient
	runtime runtimeapi.RuntimeServiceClient
	exited  chan struct{} // closed when the node's process has exited
	// cgroupRoot is the kubelet's --cgroup-root below each cgroup hierarchy, "" for the kubelet's
	// default (kubepods at the top).
	cgroupRoot string
	// seenUnpinned lists the wanted images containerd's events showed without the CRI pin
	// (watchPins); stopEvents ends the watch.
	mu           sync.Mutex
	seenUnpinned []string
	stopEvents   func()
}

// requireTools fails the test, saying what to install, when a tool the e2e runs is missing.
func requireTools(t *testing.T) {
	t.Helper()
	containerdtest.RequireRoot(t)
	for _, tool := range []string{"runc", "mkfs.ext4", "losetup", "mount", "dd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: the e2e needs runc (apt-get install runc), e2fsprogs and util-linux; .ci/run installs them", tool)
		}
	}
}

func (h *host) run(name string, args ...string) string {
	h.t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		h.t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// mountImagefs puts a fresh ext4 of size bytes on a loop device at h.imagefs.
func (h *host) mountImagefs(size int64) {
	img := filepath.Join(h.dir, "imagefs.img")
	f, err := os.Create(img)
	if err != nil {
		h.t.Fatal(err)
	}
	f.Truncate(size)
	f.Close()
	if err := os.MkdirAll(h.imagefs, 0o755); err != nil {
		h.t.Fatal(err)
	}
	h.run("mkfs.ext4", "-q", "-m", "0", "-F", img)
	h.loop = strings.TrimSpace(h.run("losetup", "-f", "--show", img))
	h.run("mount", h.loop, h.imagefs)
}

// writeFile writes content to path, making its dir.
func (h *host) writeFile(path, content string) {
	h.t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		h.t.Fatal(err)
	}
}

// startLogged starts the node's process cmd in a process group of its own (killed with the
// test), its output to a new log at path (h.log); h.exited closes once it has exited.
func (h *host) startLogged(cmd *exec.Cmd, path string) {
	h.t.Helper()
	logFile, err := os.Create(path)
	if err != nil {
		h.t.Fatal(err)
	}
	h.log = path
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		h.t.Fatal(err)
	}
	exited := make(chan struct{})
	h.exited = exited
	go func() { cmd.Wait(); logFile.Close(); close(exited) }()
}

// connect opens the containerd client and the CRI services at address.
func (h *host) connect(address string) {
	h.t.Helper()
	client, err := containerd.New(address, containerd.WithTimeout(10*time.Second))
	if err != nil {
		h.t.Fatal(err)
	}
	h.client = client
	conn := client.Conn().(*grpc.ClientConn)
	h.images, h.runtime = runtimeapi.NewImageServiceClient(conn), runtimeapi.NewRuntimeServiceClient(conn)
}

// stopPods stops and removes every pod sandbox, so that their shims exit.
func (h *host) stopPods() {
	if h.runtime == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if resp, err := h.runtime.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err == nil {
		for _, sb := range resp.Items {
			h.runtime.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sb.Id})
			h.runtime.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sb.Id})
		}
	}
}

// releaseMounts kills what is left in the kubelet's cgroups, unmounts everything below h.dir,
// detaches the loop device and removes the kubelet's cgroups (cgroupfs driver; rmdir removes only
// empty ones, deepest first).
func (h *host) releaseMounts() {
	root := "kubepods"
	if h.cgroupRoot != "" {
		root = h.cgroupRoot
	}
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/" + root)
	if more, _ := filepath.Glob("/sys/fs/cgroup/" + root); len(more) > 0 {
		dirs = append(dirs, more...)
	}
	killCgroupProcs(dirs)
	containerdtest.UnmountUnder(h.dir)
	if h.loop != "" {
		exec.Command("losetup", "-d", h.loop).Run()
	}
	for _, d := range dirs {
		exec.Command("find", d, "-depth", "-type", "d", "-exec", "rmdir", "{}", ";").Run()
	}
}

// killCgroupProcs SIGKILLs every process in the cgroup trees under dirs and waits (10 s at most)
// for them to go. A pod's containers outlive a shim killed with SIGKILL (they are reparented to
// init): seen once, two pause processes of a sandbox the kubelet created during the node's
// teardown, which also held the node's ext4 (their mount namespace) and so its loop device.
func killCgroupProcs(dirs []string) {
	procs := func() []int {
		var pids []int
		for _, d := range dirs {
			filepath.WalkDir(d, func(path string, e fs.DirEntry, err error) error {
				if err != nil || e.Name() != "cgroup.procs" {
					return nil
				}
				data, _ := os.ReadFile(path)
				for _, f := range strings.Fields(string(data)) {
					if pid, err := strconv.Atoi(f); err == nil {
						pids = append(pids, pid)
					}
				}
				return nil
			})
		}
		return pids
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		pids := procs()
		if len(pids) == 0 {
			return
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// absentPaths are those of paths that do not exist now: what a node's cleanup may remove, having
// created them (a kubelet makes /var/lib/kubelet/device-plugins whatever its --root-dir says).
func absentPaths(paths ...string) []string {
	var out []string
	for _, p := range paths {
		if _, err := os.Lstat(p); errors.Is(err, os.ErrNotExist) {
			out = append(out, p)
		}
	}
	return out
}

// lastLines is the end of the file at path.
func lastLines(path string, count int) string {
	data, _ := os.ReadFile(path)
	return tail(string(data), count)
}

// tail is the last count lines of s.
func tail(s string, count int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > count {
		lines = lines[len(lines)-count:]
	}
	return strings.Join(lines, "\n")
}

// await polls cond every 200 ms until it holds or d passes, and returns how long it took.
func (h *host) await(d time.Duration, what string, cond func() bool) time.Duration {
	h.t.Helper()
	return h.awaitEvery(d, 200*time.Millisecond, what, cond)
}

// awaitEvery is await polling every interval: a figure read off the poll is as fine as it.
func (h *host) awaitEvery(d, interval time.Duration, what string, cond func() bool) time.Duration {
	h.t.Helper()
	start := time.Now()
	for !cond() {
		select {
		case <-h.exited:
			h.t.Fatalf("the node's process exited while waiting for %s; its log ends:\n%s", what, lastLines(h.log, 30))
		default:
		}
		if time.Since(start) > d {
			h.t.Fatalf("not within %s: %s", d, what)
		}
		time.Sleep(interval)
	}
	return time.Since(start)
}

// present lists which of refs containerd holds.
func (h *host) present(refs ...string) map[string]bool {
	out := map[string]bool{}
	for _, ref := range refs {
		_, err := h.client.ImageService().Get(h.ctx, ref)
		out[ref] = err == nil
	}
	return out
}

// criPinned says whether the CRI, as the kubelet lists images, reports ref pinned.
func (h *host) criPinned(ref string) bool {
	resp, err := h.images.ImageStatus(h.ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	return err == nil && resp.GetImage().GetPinned()
}

// pins says, for each of refs, whether the CRI reports it pinned.
func (h *host) pins(refs ...string) map[string]bool {
	out := map[string]bool{}
	for _, ref := range refs {
		out[ref] = h.criPinned(ref)
	}
	return out
}

// fill writes zeros to the imagefs until leave bytes are available, and returns the file to
// remove to release the pressure.
func (h *host) fill(leave int64) string {
	var st syscall.Statfs_t
	if err := syscall.Statfs(h.imagefs, &st); err != nil {
		h.t.Fatal(err)
	}
	avail := int64(st.Bavail) * int64(st.Bsize)
	path := filepath.Join(h.imagefs, "pressure.bin")
	if fill := avail - leave; fill > 0 {
		h.run("dd", "if=/dev/zero", "of="+path, "bs=1M", fmt.Sprintf("count=%d", fill>>20), "conv=fsync", "status=none")
	}
	return path
}

// toolArchive is the images dir's archive of the tool nobody runs.
const toolArchive = "tools.tar.zst"

// imageSet names the images an e2e node is given: the images dir holds the sandbox image and the
// app's (a docker archive, as k3s's air-gap tarball) and a tool nobody runs (zstd OCI archive);
// each hand import is an archive of its own, imported later with ctr. Every image but the hand
// imports runs the sleeper; sizes are random bytes, so each costs its size on the imagefs.
type imageSet struct {
	pause, app, tool string
	hand             []string
}

// writeArchives writes set's archives: the images dir's into imagesDir, the hand imports into
// handDir (returned, in set.hand's order).
func (h *host) writeArchives(set imageSet, imagesDir, handDir, sleeperBin string) (handArchives []string) {
	sleeper := binaryLayer(h.t, sleeperBin)
	mk := func(size int64, runs bool) v1.Image {
		img, err := imagetest.Image(size, imagetest.Amd64)
		if err != nil {
			h.t.Fatal(err)
		}
		if !runs {
			return img
		}
		if img, err = mutate.AppendLayers(img, sleeper); err != nil {
			h.t.Fatal(err)
		}
		cfg, err := img.ConfigFile()
		if err != nil {
			h.t.Fatal(err)
		}
		cfg.Config.Entrypoint = []string{"/sleeper"}
		if img, err = mutate.ConfigFile(img, cfg); err != nil {
			h.t.Fatal(err)
		}
		return img
	}
	for _, d := range []string{imagesDir, handDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			h.t.Fatal(err)
		}
	}
	if err := imagetest.WriteDocker(filepath.Join(imagesDir, "airgap-images.tar"), map[string]v1.Image{set.pause: mk(64<<10, true), set.app: mk(24<<20, true)}); err != nil {
		h.t.Fatal(err)
	}
	if err := imagetest.WriteOCI(filepath.Join(imagesDir, toolArchive), map[string]any{set.tool: mk(24<<20, true)}); err != nil {
		h.t.Fatal(err)
	}
	for i, ref := range set.hand {
		path := filepath.Join(handDir, fmt.Sprintf("hand-%d.tar", i))
		if err := imagetest.WriteDocker(path, map[string]v1.Image{ref: mk(32<<20, false)}); err != nil {
			h.t.Fatal(err)
		}
		handArchives = append(handArchives, path)
	}
	return handArchives
}

// binaryLayer is a layer holding the static binary at bin in its root, under its own name
// (/sleeper).
func binaryLayer(t *testing.T, bin string) v1.Layer {
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: filepath.Base(bin), Mode: 0o755, Size: int64(len(data)), Typeflag: tar.TypeReg})
	tw.Write(data)
	tw.Close()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil })
	if err != nil {
		t.Fatal(err)
	}
	return layer
}

// watchPins follows the image events of the containerd at socket() from the moment it answers (k3s
// restarts it; a reconnect asks socket() again) and records every one of refs that an event shows
// without the CRI pin; after subscribing, it also checks the images as they are.
func (h *host) watchPins(socket func() string, refs []string) {
	ctx, cancel := context.WithCancel(h.ctx)
	done := make(chan struct{})
	h.stopEvents = func() { cancel(); <-done }
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			client, err := containerd.New(socket(), containerd.WithTimeout(time.Second))
			if err != nil {
				time.Sleep(20 * time.Millisecond)
				continue
			}
			events, errs := client.EventService().Subscribe(ctx, `topic~="/images/"`)
			for _, ref := range refs {
				if img, err := client.ImageService().Get(ctx, ref); err == nil && img.Labels[pinning.LabelPinned] != pinning.PinnedValue {
					h.sawUnpinned(ref + " (listed)")
				}
			}
			for running := true; running; {
				select {
				case env := <-events:
					ev, err := typeurl.UnmarshalAny(env.Event)
					if err != nil {
						continue
					}
					var name string
					var labels map[string]string
					switch e := ev.(type) {
					case *eventstypes.ImageCreate:
						name, labels = e.Name, e.Labels
					case *eventstypes.ImageUpdate:
						name, labels = e.Name, e.Labels
					default:
						continue
					}
					if slices.Contains(refs, name) && labels[pinning.LabelPinned] != pinning.PinnedValue {
						h.sawUnpinned(name + " (" + env.Topic + ")")
					}
				case <-errs:
					running = false
				case <-ctx.Done():
					running = false
				}
			}
			client.Close()
		}
	}()
}

func (h *host) sawUnpinned(what string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !slices.Contains(h.seenUnpinned, what) {
		h.seenUnpinned = append(h.seenUnpinned, what)
	}
}
