// Package containerdtest runs a private, real containerd (CRI on, NRI off) for tests and demos:
// its own root, state and socket under a temp dir, built from the containerd version that
// build/containerd/go.mod pins (a module of its own, so that the daemon never raises the versions
// of the k3s-pinning module, whose client may be older: k3s decides the client's version).
//
// Starting, stopping and cleaning up a daemon (Start, New, Daemon, Terminate, UnmountUnder) is
// Linux-only: process groups, a parent-death signal, unmounting what the daemon mounted. The rest
// (Build, the Matrix, StripPins) builds everywhere k3s builds agents, so that `./pkg/...` does.
package containerdtest

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"

	"github.com/k3s-pinning/k3s-pinning/internal/filelock"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Binaries are the containerd programs built from the pinned module version.
type Binaries struct {
	Containerd, Ctr, Shim string
	Version               string // containerd module version
}

const modulePath = "github.com/k3s-pinning/k3s-pinning"

var (
	buildMu sync.Mutex
	builds  = map[string]Binaries{}
)

// Build builds containerd, ctr and containerd-shim-runc-v2 of the line MatrixEnv names (the
// newest this project pins by default) once per process into a cache outside the repo (the user
// cache dir, keyed by version); the Go build cache makes rebuilds cheap. A file lock lets test
// packages running in parallel share one build.
func Build() (Binaries, error) {
	l, err := line()
	if err != nil {
		return Binaries{}, err
	}
	return BuildLine(l)
}

// BuildLine is Build for the containerd line l: "" or one of Matrix.
func BuildLine(l string) (Binaries, error) {
	if l != "" && !slices.Contains(Matrix, l) {
		return Binaries{}, fmt.Errorf("containerdtest: containerd line %q: not one of %v (or empty, for build/containerd)", l, Matrix)
	}
	buildMu.Lock()
	defer buildMu.Unlock()
	if b, ok := builds[l]; ok {
		return b, nil
	}
	b, err := build(l)
	if err == nil {
		builds[l] = b
	}
	return b, err
}

// MatrixEnv names the containerd line the tests run against: "" (build/containerd, the newest
// this project pins), or one of Matrix, built from build/containerd-<line>. make test-lines runs the
// run/keep tests and the short soak once per line.
const MatrixEnv = "K3S_PINNING_CONTAINERD"

// Matrix are the older containerd lines k3s ships that the tests also run against: 1.7 (k3s 1.31
// and older) and 2.1 (k3s 1.33 and 1.34).
var Matrix = []string{"1.7", "2.1"}

// line is the containerd line of this test process, from MatrixEnv.
func line() (string, error) {
	l := os.Getenv(MatrixEnv)
	if l != "" && !slices.Contains(Matrix, l) {
		return "", fmt.Errorf("containerdtest: %s=%q: not one of %v (or empty, for build/containerd)", MatrixEnv, l, Matrix)
	}
	return l, nil
}

// Config1 says whether the daemon reads containerd 1.x's configuration (version 2, the CRI as
// one plugin) rather than 2.x's (version 3, the CRI split into images and runtime plugins).
func (b Binaries) Config1() bool { return strings.HasPrefix(b.Version, "v1.") }

func build(l string) (Binaries, error) {
	root, err := ModuleRoot()
	if err != nil {
		return Binaries{}, err
	}
	// The daemon comes from its own module (build/containerd), not from the version of the client
	// this module links: k3s imports this module, and a test fixture must not raise its versions.
	root = filepath.Join(root, "build", "containerd")
	module := "github.com/containerd/containerd/v2"
	if l != "" {
		root += "-" + l
	}
	if l == "1.7" {
		module = "github.com/containerd/containerd"
	}
	cmds := module + "/cmd/"
	out, err := goCmd(root, "list", "-m", "-f", "{{.Version}}", module)
	if err != nil {
		return Binaries{}, err
	}
	version := strings.TrimSpace(out)
	cache, err := os.UserCacheDir()
	if err != nil {
		return Binaries{}, err
	}
	dir := filepath.Join(cache, "k3s-pinning", "containerd-"+version)
	b := Binaries{
		Containerd: filepath.Join(dir, "containerd"),
		Ctr:        filepath.Join(dir, "ctr"),
		Shim:       filepath.Join(dir, "containerd-shim-runc-v2"),
		Version:    version,
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Binaries{}, err
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return Binaries{}, err
	}
	defer lock.Close()
	if err := filelock.Lock(lock); err != nil {
		return Binaries{}, err
	}
	defer filelock.Unlock(lock)
	if allExist(b.Containerd, b.Ctr, b.Shim) {
		return b, nil
	}
	tmp, err := os.MkdirTemp(dir, "build-")
	if err != nil {
		return Binaries{}, err
	}
	defer os.RemoveAll(tmp)
	// CGO off: no btrfs/devmapper plugins needed, and no C toolchain needed.
	if _, err := goCmd(root, "build", "-o", tmp+"/", cmds+"containerd", cmds+"ctr", cmds+"containerd-shim-runc-v2"); err != nil {
		return Binaries{}, err
	}
	for _, name := range []string{"containerd", "ctr", "containerd-shim-runc-v2"} {
		if err := os.Rename(filepath.Join(tmp, name), filepath.Join(dir, name)); err != nil {
			return Binaries{}, err
		}
	}
	return b, nil
}

func allExist(paths ...string) bool {
	for _, p := range paths {
		if _, err := os.Stat(p); err != nil {
			return false
		}
	}
	return true
}

func goCmd(dir string, args ...string) (string, error) {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	// The daemon module's own go.mod decides the versions: not a workspace or vendor tree the caller
	// builds in (test/kubelet runs with GOWORK and -mod=vendor).
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

// ModuleRoot finds this module's checkout from the working directory (tests run in their package
// dir; the demo module sits inside the checkout), or from K3S_PINNING_ROOT.
func ModuleRoot() (string, error) {
	if r := os.Getenv("K3S_PINNING_ROOT"); r != "" {
		return r, nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && strings.HasPrefix(string(data), "module "+modulePath+"\n") {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("containerdtest: no checkout of %s above the working directory; set K3S_PINNING_ROOT", modulePath)
		}
		dir = parent
	}
}

// RequireRoot skips t, loudly, when not running as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		msg := "SKIPPED: NOT ROOT: this test needs a real containerd, which needs root; run `make test` as root"
		fmt.Fprintln(os.Stderr, "*** "+msg+" ***")
		t.Skip(msg)
	}
}

// StripPins removes every pin label from every image of the namespace in ctx: the CRI's, ours,
// and stock k3s's. Tests use it to play a runtime that lost them.
func StripPins(ctx context.Context, store images.Store) error {
	all, err := store.List(ctx)
	if err != nil {
		return err
	}
	for _, img := range all {
		img.Labels = nil
		if _, err := store.Update(ctx, img, pinning.LabelField(pinning.LabelPinned), pinning.LabelField(pinning.LabelSource), pinning.LabelField(pinning.LabelK3sPinned)); err != nil {
			return fmt.Errorf("strip pins of %s: %w", img.Name, err)
		}
	}
	return nil
}

// Memory is a process's memory as /proc gives it, in MiB.
type Memory struct {
	RSS  float64 // VmRSS: resident now
	HWM  float64 // VmHWM: the highest resident
	File float64 // RssFile: of the resident, the pages of files mapped (the binary's own)
}

// ProcessStat is the fields of /proc/<pid>/stat after the command's name (Linux): the state first
// (R, S, T for stopped, Z for exited and not waited for), user and system CPU ticks at 11 and 12.
func ProcessStat(pid int) ([]string, error) {
	return statFields(fmt.Sprintf("/proc/%d/stat", pid))
}

// statFields reads a stat file of /proc (a process's, or one of its threads').
func statFields(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	end := bytes.LastIndexByte(data, ')')
	if end < 0 || end+2 > len(data) {
		return nil, fmt.Errorf("%s: no command field in %q", path, data)
	}
	fields := strings.Fields(string(data[end+2:]))
	if len(fields) < 13 {
		return nil, fmt.Errorf("%s: %d fields after the command, want 13 or more", path, len(fields))
	}
	return fields, nil
}

// ProcessMemory is the memory of process pid, from /proc/<pid>/status (Linux).
func ProcessMemory(pid int) (Memory, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Memory{}, err
	}
	var m Memory
	fields := map[string]*float64{"VmRSS:": &m.RSS, "VmHWM:": &m.HWM, "RssFile:": &m.File}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && fields[f[0]] != nil {
			kib, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return Memory{}, fmt.Errorf("/proc/%d/status: %q: %w", pid, line, err)
			}
			*fields[f[0]] = kib / 1024
			delete(fields, f[0])
		}
	}
	// A process that has exited (a zombie) has no memory lines: that is an error, never 0 MiB.
	if len(fields) > 0 {
		return Memory{}, fmt.Errorf("/proc/%d/status: no %s line (has the process exited?)", pid, strings.Join(slices.Sorted(maps.Keys(fields)), " "))
	}
	return m, nil
}

// MetadataDB is the bbolt file of containerd's metadata store under root (containerd's root dir).
func MetadataDB(root string) string {
	return filepath.Join(root, "io.containerd.metadata.v1.bolt", "meta.db")
}

// Transactions is the ID of the last transaction committed to the bbolt file at path (containerd's
// metadata store, MetadataDB): each write to it, a blob's ingest opened or committed, an image
// record's create, a label's update, a lease, is one transaction, and one sync of the disk; a cold
// load waits on them. It reads the two meta pages (page header 16 bytes, then magic, version,
// page size, flags, the root bucket (16), the freelist and high-water page IDs, the transaction
// ID) and takes the newer.
func Transactions(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var id, size uint64
	page := make([]byte, 72)
	for meta := range uint64(2) {
		if _, err := f.ReadAt(page, int64(meta*size)); err != nil {
			return 0, fmt.Errorf("%s: %w", path, err)
		}
		if binary.LittleEndian.Uint32(page[16:20]) != 0xED0CDAED {
			return 0, fmt.Errorf("%s: meta page %d: not a bbolt meta page", path, meta)
		}
		size = uint64(binary.LittleEndian.Uint32(page[24:28])) // meta 0's page size: where meta 1 is
		id = max(id, binary.LittleEndian.Uint64(page[64:72]))
	}
	return id, nil
}

// TransactionFloor is the fewest metadata transactions any load through containerd's API can make
// to leave what containerd holds now (cs's blobs, is's image records): a blob's ingest opened and
// committed (two), an image record created with its labels (one; the CRI's image ID records,
// named sha256:<image ID>, among them), nothing labelled after, no lease. A name created without
// the CRI's "managed" label costs one more: the CRI's update, which writes it. With the counts
// it comes from.
func TransactionFloor(ctx context.Context, cs content.Store, is images.Store) (floor, blobs, records, ids uint64, err error) {
	if err := cs.Walk(ctx, func(content.Info) error { blobs++; return nil }); err != nil {
		return 0, 0, 0, 0, err
	}
	imgs, err := is.List(ctx)
	if err != nil {
		return 0, 0, 0, 0, err
	}
	for _, img := range imgs {
		if strings.HasPrefix(img.Name, "sha256:") {
			ids++
		}
	}
	records = uint64(len(imgs))
	return 2*blobs + records, blobs, records, ids, nil
}
