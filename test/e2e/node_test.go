package e2e_test

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// The node's images. The images dir holds the sandbox image (as k3s's air-gap tarball does), the
// image the static pod runs and one nobody runs; one more image is imported by hand and is wanted
// by nobody: the kubelet's reclaim must collect it, or it did not run.
const (
	pauseRef    = "airgap.example/e2e/pause:3.10"
	appRef      = "airgap.example/e2e/app:1.0"
	toolRef     = "airgap.example/e2e/tool:1.0"
	unwantedRef = "registry.example/scratch/unwanted:1.0"

	podName  = "airgap-app"
	nodeName = "e2e-node"
	// imagefsSize is the loop-mounted ext4 holding containerd's root: the kubelet's imagefs.
	imagefsSize = 400 << 20
	// evictionThreshold is imagefs.available in evictionHard; pressure leaves 20 MiB less.
	evictionThreshold = 120 << 20
)

var airgapRefs = []string{pauseRef, appRef, toolRef}

// node is one e2e node: a loop-mounted imagefs, a private containerd on it, and e2e-node (the
// agent and the kubelet in one process). Everything lives in dir; cleanup always runs.
type node struct {
	t         *testing.T
	ctx       context.Context
	dir       string
	imagefs   string // mount point of the loop device
	loop      string // the loop device
	imagesDir string
	manifests string
	daemon    *containerdtest.Daemon
	client    *containerd.Client
	images    runtimeapi.ImageServiceClient
	runtime   runtimeapi.RuntimeServiceClient
	port      int // the kubelet's read-only port, for /pods
	log       string
	kubelet   *exec.Cmd
	exited    chan struct{}
}

// nodeOptions choose how the node loads its images and what protects them.
type nodeOptions struct {
	agent    string // e2e-node --agent: run, sync or off
	filter   bool   // e2e-node --gc-filter
	imported bool   // the images dir's archives are imported by hand with ctr, unpinned (control)
}

func newNode(t *testing.T, opts nodeOptions) *node {
	t.Helper()
	containerdtest.RequireRoot(t)
	for _, tool := range []string{"runc", "mkfs.ext4", "losetup", "mount", "dd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: the e2e needs runc (apt-get install runc), e2fsprogs and util-linux; .ci/run installs them", tool)
		}
	}
	nodeBin := buildNode(t)
	dir, err := os.MkdirTemp("", "k3s-pinning-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(namespaces.WithNamespace(context.Background(), pinning.DefaultNamespace), 10*time.Minute)
	n := &node{t: t, ctx: ctx, dir: dir, imagefs: filepath.Join(dir, "imagefs"), imagesDir: filepath.Join(dir, "images"),
		manifests: filepath.Join(dir, "manifests"), log: filepath.Join(dir, "node.log")}
	t.Cleanup(func() { n.cleanup(); cancel() })
	for _, d := range []string{n.imagefs, n.imagesDir, n.manifests, filepath.Join(dir, "hand"), filepath.Join(dir, "kubelet"), filepath.Join(dir, "pod-logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.mountImagefs()
	n.writeArchives()
	n.daemon, err = containerdtest.Start(ctx, dir, containerdtest.Options{Root: filepath.Join(n.imagefs, "containerd"), SandboxImage: pauseRef})
	if err != nil {
		t.Fatal(err)
	}
	if n.client, err = n.daemon.Client(); err != nil {
		t.Fatal(err)
	}
	conn := n.client.Conn().(*grpc.ClientConn)
	n.images, n.runtime = runtimeapi.NewImageServiceClient(conn), runtimeapi.NewRuntimeServiceClient(conn)
	n.ctrImport(filepath.Join(dir, "hand", "unwanted.tar"))
	if opts.imported {
		for _, f := range []string{"airgap-images.tar", "tools.tar.zst"} {
			n.ctrImport(filepath.Join(n.imagesDir, f))
		}
	}
	n.writeManifest()
	n.startKubelet(nodeBin, opts)
	return n
}

// buildNode builds e2e-node (the kubelet and the agent) once per test binary, from the
// vendored, patched tree the test itself is built from (GOWORK, -mod=vendor).
func buildNode(t *testing.T) string {
	t.Helper()
	nodeBinOnce.Do(func() {
		cache, err := os.UserCacheDir()
		if err != nil {
			nodeBinErr = err
			return
		}
		nodeBin = filepath.Join(cache, "k3s-pinning", "e2e", "e2e-node")
		for _, cmd := range []string{"e2e-node", "sleeper"} {
			out, err := exec.Command("go", "build", "-mod=vendor", "-o", filepath.Join(filepath.Dir(nodeBin), cmd), "./cmd/"+cmd).CombinedOutput()
			if err != nil {
				nodeBinErr = fmt.Errorf("go build ./cmd/%s: %v\n%s", cmd, err, out)
				return
			}
		}
	})
	if nodeBinErr != nil {
		t.Fatal(nodeBinErr)
	}
	return nodeBin
}

// mountImagefs puts a fresh ext4 on a loop device at n.imagefs.
func (n *node) mountImagefs() {
	img := filepath.Join(n.dir, "imagefs.img")
	f, err := os.Create(img)
	if err != nil {
		n.t.Fatal(err)
	}
	f.Truncate(imagefsSize)
	f.Close()
	n.run("mkfs.ext4", "-q", "-m", "0", "-F", img)
	n.loop = strings.TrimSpace(n.run("losetup", "-f", "--show", img))
	n.run("mount", n.loop, n.imagefs)
}

func (n *node) run(name string, args ...string) string {
	n.t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		n.t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func (n *node) ctrImport(path string) {
	n.run(n.daemon.Bin.Ctr, "-a", n.daemon.Address, "-n", pinning.DefaultNamespace, "images", "import", path)
}

// writeArchives writes the images dir (a docker archive and a zstd OCI archive) and the hand
// import. Every image but the unwanted one runs the sleeper; sizes are random bytes, so that
// each costs its size twice on the imagefs (content and snapshot).
func (n *node) writeArchives() {
	sleeper := sleeperLayer(n.t, filepath.Join(filepath.Dir(nodeBin), "sleeper"))
	mk := func(size int64, runs bool) v1.Image {
		img, err := imagetest.Image(size, imagetest.Amd64)
		if err != nil {
			n.t.Fatal(err)
		}
		if !runs {
			return img
		}
		if img, err = mutate.AppendLayers(img, sleeper); err != nil {
			n.t.Fatal(err)
		}
		cfg, err := img.ConfigFile()
		if err != nil {
			n.t.Fatal(err)
		}
		cfg.Config.Entrypoint = []string{"/sleeper"}
		if img, err = mutate.ConfigFile(img, cfg); err != nil {
			n.t.Fatal(err)
		}
		return img
	}
	if err := imagetest.WriteDocker(filepath.Join(n.imagesDir, "airgap-images.tar"), map[string]v1.Image{pauseRef: mk(64<<10, true), appRef: mk(24<<20, true)}); err != nil {
		n.t.Fatal(err)
	}
	if err := imagetest.WriteOCI(filepath.Join(n.imagesDir, "tools.tar.zst"), map[string]any{toolRef: mk(24<<20, true)}); err != nil {
		n.t.Fatal(err)
	}
	if err := imagetest.WriteDocker(filepath.Join(n.dir, "hand", "unwanted.tar"), map[string]v1.Image{unwantedRef: mk(32<<20, false)}); err != nil {
		n.t.Fatal(err)
	}
}

// sleeperLayer is a layer holding the static sleeper binary as /sleeper.
func sleeperLayer(t *testing.T, bin string) v1.Layer {
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "sleeper", Mode: 0o755, Size: int64(len(data)), Typeflag: tar.TypeReg})
	tw.Write(data)
	tw.Close()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil })
	if err != nil {
		t.Fatal(err)
	}
	return layer
}

// writeManifest puts the static pod's manifest (back) in place.
func (n *node) writeManifest() {
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: default}
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 1
  containers:
  - name: app
    image: %s
    imagePullPolicy: Never
`, podName, appRef)
	if err := os.WriteFile(filepath.Join(n.manifests, podName+".yaml"), []byte(manifest), 0o644); err != nil {
		n.t.Fatal(err)
	}
}

func (n *node) removeManifest() {
	if err := os.Remove(filepath.Join(n.manifests, podName+".yaml")); err != nil {
		n.t.Fatal(err)
	}
}

func freePort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startKubelet starts e2e-node with the kubelet configured as ../shared/reference/e2e-diskpressure
// found works on these VMs (cgroup v1, no CAP_SYS_RESOURCE), and a read-only port for /pods.
func (n *node) startKubelet(bin string, opts nodeOptions) {
	n.port = freePort(n.t)
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
staticPodPath: %[1]s/manifests
fileCheckFrequency: 1s
containerRuntimeEndpoint: unix://%[2]s
imageServiceEndpoint: unix://%[2]s
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
enableServer: false
address: 127.0.0.1
readOnlyPort: %[3]d
healthzPort: 0
podLogsDir: %[1]s/pod-logs
volumePluginDir: %[1]s/volume-plugins
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%%"
  nodefs.inodesFree: "1%%"
  imagefs.available: "%[4]dMi"
  imagefs.inodesFree: "1%%"
evictionPressureTransitionPeriod: 5s
imageGCHighThresholdPercent: 90
imageGCLowThresholdPercent: 80
imageMinimumGCAge: 1s
`, n.dir, n.daemon.Address, n.port, evictionThreshold>>20)
	cfgPath := filepath.Join(n.dir, "kubelet.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		n.t.Fatal(err)
	}
	logFile, err := os.Create(n.log)
	if err != nil {
		n.t.Fatal(err)
	}
	args := []string{"--containerd-address", n.daemon.Address, "--images-dir", n.imagesDir,
		"--state-file", filepath.Join(n.dir, "state.json"), "--agent", opts.agent, fmt.Sprintf("--gc-filter=%t", opts.filter), "--",
		"--config", cfgPath, "--root-dir", filepath.Join(n.dir, "kubelet"), "--cert-dir", filepath.Join(n.dir, "kubelet", "pki"),
		"--hostname-override", nodeName, "--v=2"}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		n.t.Fatal(err)
	}
	n.kubelet, n.exited = cmd, make(chan struct{})
	go func() { cmd.Wait(); logFile.Close(); close(n.exited) }()
}

// cleanup stops everything newNode started, whatever state the test left it in: the kubelet, the
// pods (so their shims exit), containerd, every mount below dir, the loop device, the kubelet's
// cgroups.
func (n *node) cleanup() {
	if n.kubelet != nil {
		containerdtest.Terminate(n.kubelet.Process, n.exited, 10*time.Second)
	}
	if n.runtime != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if resp, err := n.runtime.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err == nil {
			for _, sb := range resp.Items {
				n.runtime.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sb.Id})
				n.runtime.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sb.Id})
			}
		}
		cancel()
	}
	if n.client != nil {
		n.client.Close()
	}
	if n.daemon != nil {
		n.daemon.Stop()
	}
	if n.t.Failed() {
		n.t.Logf("node log (%s), last lines:\n%s", n.log, lastLines(n.log, 40))
	}
	containerdtest.UnmountUnder(n.dir)
	if n.loop != "" {
		exec.Command("losetup", "-d", n.loop).Run()
	}
	// cgroups the kubelet made (cgroupfs driver); rmdir removes only empty ones, deepest first
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/kubepods")
	if more, _ := filepath.Glob("/sys/fs/cgroup/kubepods"); len(more) > 0 {
		dirs = append(dirs, more...)
	}
	for _, d := range dirs {
		exec.Command("find", d, "-depth", "-type", "d", "-exec", "rmdir", "{}", ";").Run()
	}
	os.RemoveAll(n.dir)
}

func lastLines(path string, count int) string {
	data, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > count {
		lines = lines[len(lines)-count:]
	}
	return strings.Join(lines, "\n")
}

// await polls cond every 200 ms until it holds or d passes, and returns how long it took.
func (n *node) await(d time.Duration, what string, cond func() bool) time.Duration {
	n.t.Helper()
	start := time.Now()
	for !cond() {
		select {
		case <-n.exited:
			n.t.Fatalf("e2e-node exited while waiting for %s", what)
		default:
		}
		if time.Since(start) > d {
			n.t.Fatalf("not within %s: %s", d, what)
		}
		time.Sleep(200 * time.Millisecond)
	}
	return time.Since(start)
}

// present lists which of refs containerd holds.
func (n *node) present(refs ...string) map[string]bool {
	out := map[string]bool{}
	for _, ref := range refs {
		_, err := n.client.ImageService().Get(n.ctx, ref)
		out[ref] = err == nil
	}
	return out
}

// criPinned says whether the CRI, as the kubelet lists images, reports ref pinned.
func (n *node) criPinned(ref string) bool {
	resp, err := n.images.ImageStatus(n.ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	return err == nil && resp.GetImage().GetPinned()
}

// podState is the static pod's container state as the kubelet reports it on /pods: "Running",
// the reason it waits (ErrImageNeverPull), "Terminated", or "absent".
func (n *node) podState() string {
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/pods", n.port))
	if err != nil {
		return "kubelet not answering"
	}
	defer resp.Body.Close()
	var pods corev1.PodList
	if err := json.NewDecoder(resp.Body).Decode(&pods); err != nil {
		return "bad /pods: " + err.Error()
	}
	for _, pod := range pods.Items {
		if pod.Name != podName+"-"+nodeName {
			continue
		}
		for _, c := range pod.Status.ContainerStatuses {
			switch {
			case c.State.Running != nil:
				return "Running"
			case c.State.Waiting != nil && c.State.Waiting.Reason != "":
				return c.State.Waiting.Reason
			case c.State.Terminated != nil:
				return "Terminated"
			}
		}
		return "Pending"
	}
	return "absent"
}

// appContainers counts the containers of the static pod the runtime still holds.
func (n *node) appContainers() int {
	resp, err := n.runtime.ListContainers(n.ctx, &runtimeapi.ListContainersRequest{})
	if err != nil {
		n.t.Fatalf("CRI ListContainers: %v", err)
	}
	count := 0
	for _, c := range resp.Containers {
		if c.GetMetadata().GetName() == "app" {
			count++
		}
	}
	return count
}

// pressure fills the imagefs until 20 MiB less than the eviction threshold is available, and
// returns the file to remove to release it.
func (n *node) pressure() string {
	var st syscall.Statfs_t
	if err := syscall.Statfs(n.imagefs, &st); err != nil {
		n.t.Fatal(err)
	}
	avail := int64(st.Bavail) * st.Bsize
	fill := avail - (evictionThreshold - 20<<20)
	path := filepath.Join(n.imagefs, "pressure.bin")
	if fill > 0 {
		n.run("dd", "if=/dev/zero", "of="+path, "bs=1M", fmt.Sprintf("count=%d", fill>>20), "conv=fsync", "status=none")
	}
	return path
}

// stripPins removes every pin label from every image: a runtime that lost them.
func (n *node) stripPins() {
	if err := containerdtest.StripPins(n.ctx, n.client.ImageService()); err != nil {
		n.t.Fatal(err)
	}
}
