// Package containerdtest runs a private, real containerd (CRI on, NRI off) for tests and demos:
// its own root, state and socket under a temp dir, built from the containerd version that
// build/containerd/go.mod pins (a module of its own, so that the daemon never raises the versions
// of the k3s-pinning module, whose client may be older: k3s decides the client's version).
package containerdtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

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
// this project pins), or one of Matrix, built from build/containerd-<line>. make test runs the
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

// Daemon is a running private containerd.
type Daemon struct {
	Dir     string // everything of this daemon lives here
	Address string // its gRPC socket (the CRI is served there too)
	Root    string
	Config  string
	Log     string
	Bin     Binaries

	cmd     *exec.Cmd
	exited  chan struct{}
	logFile *os.File
}

// Options change the daemon's configuration.
type Options struct {
	// Root is containerd's root dir (the kubelet's imagefs); default Dir/root. An e2e test points
	// it at a small loop-mounted filesystem.
	Root string
	// SandboxImage is pinned by containerd itself (pinned_images.sandbox).
	SandboxImage string
	// Line is the containerd line to run, "" or one of Matrix; default: what MatrixEnv says.
	Line string
}

// Start starts containerd in dir (which must be short: unix socket paths are limited to 107
// bytes) and waits until it answers.
func Start(ctx context.Context, dir string, opts Options) (*Daemon, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("containerdtest: containerd needs root (overlayfs snapshotter, mounts)")
	}
	l, err := line()
	if err != nil {
		return nil, err
	}
	if opts.Line != "" {
		l = opts.Line
	}
	bin, err := BuildLine(l)
	if err != nil {
		return nil, err
	}
	d := &Daemon{Dir: dir, Address: filepath.Join(dir, "containerd.sock"), Root: opts.Root,
		Config: filepath.Join(dir, "containerd.toml"), Log: filepath.Join(dir, "containerd.log"), Bin: bin}
	if len(d.Address) > 100 {
		return nil, fmt.Errorf("containerdtest: socket path %s too long for a unix socket", d.Address)
	}
	if d.Root == "" {
		d.Root = filepath.Join(dir, "root")
	}
	if err := os.WriteFile(d.Config, []byte(d.config(opts)), 0o644); err != nil {
		return nil, err
	}
	return d, d.start(ctx)
}

// config is the daemon's configuration: the same settings in containerd 2.x's version 3 format
// or, for 1.7, in its version 2 format (the CRI one plugin there, two here).
func (d *Daemon) config(opts Options) string {
	version, plugins := 3, `[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'%[2]s
  [plugins.'io.containerd.cri.v1.runtime']
    # these VMs lack CAP_SYS_RESOURCE: runc cannot set oom_score_adj=-998 for sandboxes otherwise
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      conf_dir = '%[1]s/cni'
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
`
	sandbox := "\n    [plugins.'io.containerd.cri.v1.images'.pinned_images]\n      sandbox = '%s'"
	if d.Bin.Config1() {
		version, plugins = 2, `[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true%[2]s
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = 'overlayfs'
  [plugins."io.containerd.grpc.v1.cri".cni]
    conf_dir = '%[1]s/cni'
[plugins."io.containerd.nri.v1.nri"]
  disable = true
`
		sandbox = "\n  sandbox_image = '%s'"
	}
	if opts.SandboxImage != "" {
		sandbox = fmt.Sprintf(sandbox, opts.SandboxImage)
	} else {
		sandbox = ""
	}
	return fmt.Sprintf(`version = %d
root = '%s'
state = '%s/state'
disabled_plugins = ['io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.zfs', 'io.containerd.snapshotter.v1.devmapper', 'io.containerd.snapshotter.v1.aufs', 'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']
[grpc]
  address = '%[4]s'
[ttrpc]
  address = '%[4]s.ttrpc'
`, version, d.Root, d.Dir, d.Address) + fmt.Sprintf(plugins, d.Dir, sandbox)
}

func (d *Daemon) start(ctx context.Context) error {
	logFile, err := os.OpenFile(d.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(d.Bin.Containerd, "--config", d.Config)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// the shim must be on containerd's PATH, and the daemon dies with us
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(d.Bin.Shim)+":"+os.Getenv("PATH"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return err
	}
	d.cmd, d.logFile, d.exited = cmd, logFile, make(chan struct{})
	go func() { cmd.Wait(); close(d.exited) }()

	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-d.exited:
			return fmt.Errorf("containerd exited at start; log %s:\n%s", d.Log, tail(d.Log))
		case <-ctx.Done():
			d.Stop()
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if d.serving(ctx) {
			return nil
		}
	}
	d.Stop()
	return fmt.Errorf("containerd did not answer within 30s; log %s:\n%s", d.Log, tail(d.Log))
}

// serving reports whether containerd answers, and its CRI plugin too: the CRI initializes after
// the daemon serves, and answers "server is not initialized yet" meanwhile, which a test (or the
// soak's next fault, right after a restart) would take for a failure.
func (d *Daemon) serving(ctx context.Context) bool {
	if _, err := os.Stat(d.Address); err != nil {
		return false
	}
	c, err := containerd.New(d.Address, containerd.WithTimeout(time.Second))
	if err != nil {
		return false
	}
	defer c.Close()
	if ok, err := c.IsServing(ctx); err != nil || !ok {
		return false
	}
	conn, ok := c.Conn().(*grpc.ClientConn)
	if !ok {
		return false
	}
	_, err = runtimeapi.NewImageServiceClient(conn).ImageFsInfo(ctx, &runtimeapi.ImageFsInfoRequest{})
	return err == nil
}

// Client returns a new client for the daemon; the caller closes it.
func (d *Daemon) Client() (*containerd.Client, error) {
	return containerd.New(d.Address, containerd.WithTimeout(10*time.Second))
}

// Stop stops containerd (SIGTERM, then SIGKILL after 10 s). Safe to call twice.
func (d *Daemon) Stop() error {
	if d.cmd == nil {
		return nil
	}
	Terminate(d.cmd.Process, d.exited, 10*time.Second)
	d.cmd = nil
	d.logFile.Close()
	return nil
}

// Terminate stops a process started in its own process group: SIGTERM, then SIGKILL to the whole
// group if exited is not closed within grace.
func Terminate(p *os.Process, exited <-chan struct{}, grace time.Duration) {
	p.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(grace):
		syscall.Kill(-p.Pid, syscall.SIGKILL)
		<-exited
	}
}

// Restart stops and starts the daemon with the same root and state.
func (d *Daemon) Restart(ctx context.Context) error {
	d.Stop()
	return d.start(ctx)
}

func tail(path string) string {
	data, _ := os.ReadFile(path)
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(data)
}

// New starts a private containerd for t and stops it when t ends. Without root the test is
// skipped, loudly: containerd's overlayfs snapshotter and the CRI need it.
func New(t testing.TB, opts Options) *Daemon {
	t.Helper()
	RequireRoot(t)
	dir, err := os.MkdirTemp("", "ctrd-")
	if err != nil {
		t.Fatal(err)
	}
	d, err := Start(context.Background(), dir, opts)
	if err != nil {
		os.RemoveAll(dir)
		t.Fatal(err)
	}
	t.Logf("containerd %s", d.Bin.Version)
	t.Cleanup(func() {
		d.Stop()
		if t.Failed() {
			t.Logf("containerd %s log (%s):\n%s", d.Bin.Version, d.Log, tail(d.Log))
		}
		UnmountUnder(dir)
		os.RemoveAll(dir)
	})
	return d
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

// UnmountUnder unmounts, deepest first, everything mounted below dir: what a daemon, a kubelet
// or a test left there (snapshot mounts, sandbox shm, the kubelet root-dir bind mount).
func UnmountUnder(dir string) {
	data, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return
	}
	var mounts []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && strings.HasPrefix(f[1], dir+"/") {
			mounts = append(mounts, f[1])
		}
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		syscall.Unmount(mounts[i], syscall.MNT_DETACH)
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
