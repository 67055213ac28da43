//go:build linux

package containerdtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

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
	d.cmd.Process.Signal(syscall.SIGCONT) // a frozen daemon takes no SIGTERM
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

// Freeze stops containerd where it is (SIGSTOP): its socket accepts, and nothing answers, as a
// daemon that hangs. thaw (SIGCONT) lets it go on; Stop thaws it first.
func (d *Daemon) Freeze() (thaw func()) {
	if d.cmd == nil {
		return func() {}
	}
	p := d.cmd.Process
	p.Signal(syscall.SIGSTOP)
	// SIGSTOP takes effect when each of containerd's threads next runs: on a busy machine a
	// thread could still answer a call made right after the signal. Return once every thread
	// is stopped (bounded: a process that never stops is the test's to notice).
	deadline := time.Now().Add(5 * time.Second)
	for !stopped(p.Pid) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	return func() { p.Signal(syscall.SIGCONT) }
}

// stopped says whether every thread of process pid is stopped (state T in /proc).
func stopped(pid int) bool {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		fields, err := statFields(task)
		if err != nil || fields[0] != "T" {
			return false
		}
	}
	return true
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
