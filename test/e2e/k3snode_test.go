package e2e_test

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// k3sNode is one k3s process of make k3s and what it runs on: the single server of make k3s-e2e
// and make bench (on this host, at k3s's fixed paths), or one node of make cluster-e2e (in network
// and mount namespaces of its own, netns). Every start runs the same data dir again; the scenario
// files say with which arguments.
type k3sNode struct {
	*host
	bin       string // make k3s's bin dir: k3s and its multicall links (ctr, crictl, kubectl)
	name      string // the Node's name
	pinning   bool   // false: --disable-image-pinning, stock k3s's own import
	data      string // k3s's --data-dir, as seen from this host
	imagesDir string
	netns     string   // its network namespace; "" for this host's
	path      []string // dirs before $PATH for k3s and the tools run on the node
	// hand are the hand-import archives by reference, which handImport imports as an operator
	// would.
	hand   map[string]string
	cmd    *exec.Cmd
	pid    atomic.Int64 // k3s's, for the event watch's reconnects
	starts int
	logs   []string // the log of each start
}

// launch starts k3s with args (those after the binary) and env added, in the node's namespaces,
// logging each start to a file of its own, and returns when it started.
func (n *k3sNode) launch(args []string, env ...string) time.Time {
	n.t.Helper()
	n.starts++
	k3s := filepath.Join(n.bin, "k3s")
	cmd := exec.Command(k3s, args...)
	if n.netns != "" {
		// nsenter, unshare and the script each exec the next: the process is k3s.
		cmd = exec.Command("nsenter", append([]string{"--net=/run/netns/" + n.netns, "--", "unshare", "--mount", "--propagation", "slave", "--",
			"sh", "-c", nodeScript, "k3s-node", k3s}, args...)...)
		env = append([]string{"NODE_DIR=" + n.dir}, env...)
	}
	cmd.Env = append(os.Environ(), append([]string{"PATH=" + n.pathEnv()}, env...)...)
	start := time.Now()
	n.startLogged(cmd, filepath.Join(n.dir, fmt.Sprintf("k3s-%d.log", n.starts)))
	n.cmd = cmd
	n.pid.Store(int64(cmd.Process.Pid))
	n.logs = append(n.logs, n.log)
	return start
}

func (n *k3sNode) pathEnv() string {
	return strings.Join(append(slices.Clone(n.path), n.bin, os.Getenv("PATH")), ":")
}

// socket is its containerd's socket: k3s's fixed path, seen through the node's mount namespace
// when it has one.
func (n *k3sNode) socket() string {
	if n.netns == "" {
		return k3sContainerdSocket
	}
	return fmt.Sprintf("/proc/%d/root%s", n.pid.Load(), k3sContainerdSocket)
}

// awaitContainerd waits up to d for k3s's containerd to answer on its socket, and connects.
func (n *k3sNode) awaitContainerd(d time.Duration) {
	n.t.Helper()
	n.await(d, n.name+": containerd of k3s answering", func() bool {
		if n.client != nil {
			return true
		}
		if _, err := os.Stat(n.socket()); err != nil {
			return false
		}
		n.connect(n.socket())
		return true
	})
}

// stop stops k3s (SIGTERM, as systemd does) and waits for it; pods keep running, as on a real
// restart.
func (n *k3sNode) stop() {
	n.t.Helper()
	if n.client != nil {
		n.client.Close()
		n.client = nil
	}
	if n.cmd == nil {
		return
	}
	containerdtest.Terminate(n.cmd.Process, n.exited, 30*time.Second)
	n.cmd = nil
}

// exec runs a command in the node's namespaces (those of its k3s process), with make k3s's bin
// dir on PATH.
func (n *k3sNode) exec(name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	if n.netns != "" {
		cmd = exec.Command("nsenter", append([]string{"-t", strconv.FormatInt(n.pid.Load(), 10), "-n", "-m", "--", name}, args...)...)
	}
	cmd.Env = append(os.Environ(), "PATH="+n.pathEnv())
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// tool runs k3s's ctr, crictl or kubectl on the node: the multicall binary under that name, which
// is what `k3s ctr` and `k3s crictl` of a release k3s exec (its outer wrapper runs them from its
// data dir; make k3s builds the inner binary, whose own `ctr` subcommand would see "ctr" as its
// first argument).
func (n *k3sNode) tool(name string, args ...string) (string, error) {
	return n.exec(filepath.Join(n.bin, name), args...)
}

// mustTool is tool, failing the test when the command fails.
func (n *k3sNode) mustTool(name string, args ...string) string {
	n.t.Helper()
	out, err := n.tool(name, args...)
	if err != nil {
		n.t.Fatalf("%s: %s %s: %v\n%s", n.name, name, strings.Join(args, " "), err, out)
	}
	return out
}

// ctr runs k3s's ctr against its containerd, in the CRI's namespace.
func (n *k3sNode) ctr(args ...string) string {
	n.t.Helper()
	return n.mustTool("ctr", append([]string{"-a", k3sContainerdSocket, "-n", pinning.DefaultNamespace}, args...)...)
}

// crictl runs k3s's crictl against its containerd's CRI.
func (n *k3sNode) crictl(args ...string) (string, error) {
	return n.tool("crictl", append([]string{"--runtime-endpoint", "unix://" + k3sContainerdSocket}, args...)...)
}

// handImport imports the node's hand archives with k3s's `ctr images import`, as an operator
// would, in the order of their references.
func (n *k3sNode) handImport() {
	n.t.Helper()
	for _, ref := range slices.Sorted(maps.Keys(n.hand)) {
		n.ctr("images", "import", n.hand[ref])
	}
}

// k3sPinning runs the k3s-pinning command (k3sPinningCLI) in the node's network namespace: its
// stdout, then its stderr when it fails (stdout alone is parsed: -o json), and its exit code.
func (n *k3sNode) k3sPinning(args ...string) (string, int) {
	n.t.Helper()
	cmd := exec.Command(k3sPinningCLI(n.t), args...)
	if n.netns != "" {
		cmd = exec.Command("ip", append([]string{"netns", "exec", n.netns, k3sPinningCLI(n.t)}, args...)...)
	}
	out, err := cmd.Output()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return string(out) + string(exit.Stderr), exit.ExitCode()
	}
	if err != nil {
		n.t.Fatal(err)
	}
	return string(out), 0
}

// statusCluster is `k3s-pinning status --cluster` with flags and the kubeconfig k3s wrote for the
// node (a server's).
func (n *k3sNode) statusCluster(flags ...string) (string, int) {
	n.t.Helper()
	return n.k3sPinning(append([]string{"status", "--cluster", "--kubeconfig", filepath.Join(n.dir, "kubeconfig")}, flags...)...)
}

// kubectlRunner runs kubectl against one API server; command makes its command line (make k3s's
// multicall link with the server's kubeconfig, in whatever namespace reaches the server).
type kubectlRunner struct {
	kt      *testing.T
	command func(args ...string) *exec.Cmd
}

func (k kubectlRunner) kubectl(args ...string) (string, error) {
	out, err := k.command(args...).CombinedOutput()
	return string(out), err
}

func (k kubectlRunner) kubectlOK(args ...string) bool {
	_, err := k.kubectl(args...)
	return err == nil
}

func (k kubectlRunner) mustKubectl(args ...string) string {
	k.kt.Helper()
	out, err := k.kubectl(args...)
	if err != nil {
		k.kt.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}
