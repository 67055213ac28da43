package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	corev1 "k8s.io/api/core/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
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
	*host
	imagesDir string
	manifests string
	daemon    *containerdtest.Daemon
	port      int // the kubelet's read-only port, for /pods
	kubelet   *exec.Cmd
	// agentMetrics is the k3s-pinning pod's /metrics (agentPod), what its liveness probe asks.
	agentMetrics string
}

// nodeOptions choose how the node loads its images and what protects them.
type nodeOptions struct {
	agent    string // e2e-node --agent: run, sync or off
	filter   bool   // e2e-node --gc-filter
	imported bool   // the images dir's archives are imported by hand with ctr, unpinned (control)
	// agentPod delivers k3s-pinning as make release does: its image archive in the images dir,
	// imported by `k3s-pinning sync` before the kubelet starts (as k3s imports agent/images), and
	// the DaemonSet's pod template run by the kubelet as a static pod.
	agentPod bool
}

func newNode(t *testing.T, opts nodeOptions) *node {
	t.Helper()
	requireTools(t)
	nodeBin := testBinary(t, "e2e-node")
	dir, err := os.MkdirTemp("", "k3s-pinning-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(namespaces.WithNamespace(context.Background(), pinning.DefaultNamespace), 10*time.Minute)
	n := &node{host: &host{t: t, ctx: ctx, dir: dir, imagefs: filepath.Join(dir, "imagefs"), log: filepath.Join(dir, "node.log")},
		imagesDir: filepath.Join(dir, "images"), manifests: filepath.Join(dir, "manifests")}
	// The kubelet makes these whatever its flags say (its container log links always go to
	// /var/log/containers): the cleanup removes those it made.
	created := absentPaths("/var/lib/kubelet", "/var/log/containers")
	t.Cleanup(func() {
		n.cleanup()
		for _, p := range created {
			os.RemoveAll(p)
		}
		cancel()
	})
	for _, d := range []string{n.manifests, filepath.Join(dir, "kubelet"), filepath.Join(dir, "pod-logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.mountImagefs(imagefsSize)
	hand := n.writeArchives(imageSet{pause: pauseRef, app: appRef, tool: toolRef, hand: []string{unwantedRef}}, n.imagesDir, filepath.Join(dir, "hand"), testBinary(t, "sleeper"))
	n.daemon, err = containerdtest.Start(ctx, dir, containerdtest.Options{Root: filepath.Join(n.imagefs, "containerd"), SandboxImage: pauseRef})
	if err != nil {
		t.Fatal(err)
	}
	n.connect(n.daemon.Address)
	n.ctrImport(hand[0])
	if opts.imported {
		for _, f := range []string{"airgap-images.tar", "tools.tar.zst"} {
			n.ctrImport(filepath.Join(n.imagesDir, f))
		}
	}
	if opts.agentPod {
		n.deployAgentPod()
	}
	n.writeManifest()
	n.startKubelet(nodeBin, opts)
	return n
}

// testBinary builds ./cmd/<name> of this module (e2e-node: the kubelet and the agent; sleeper)
// once per test binary, from the vendored, patched tree the test itself is built from (GOWORK,
// -mod=vendor), into the user cache dir.
func testBinary(t *testing.T, name string) string {
	t.Helper()
	builtBinaries.Lock()
	defer builtBinaries.Unlock()
	if path, ok := builtBinaries.paths[name]; ok {
		return path
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(cache, "k3s-pinning", "e2e", name)
	build := exec.Command("go", "build", "-mod=vendor", "-o", path, "./cmd/"+name)
	if name == "netcheck" {
		// It runs alone in a test image, without a libc: its net/http must not need cgo.
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
	}
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/%s: %v\n%s", name, err, out)
	}
	builtBinaries.paths[name] = path
	return path
}

var builtBinaries = struct {
	sync.Mutex
	paths map[string]string
}{paths: map[string]string{}}

func (n *node) ctrImport(path string) {
	n.run(n.daemon.Bin.Ctr, "-a", n.daemon.Address, "-n", pinning.DefaultNamespace, "images", "import", path)
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
	n.stopPods()
	if n.client != nil {
		n.client.Close()
	}
	if n.daemon != nil {
		n.daemon.Stop()
	}
	if n.t.Failed() {
		n.t.Logf("node log (%s), last lines:\n%s", n.log, lastLines(n.log, 40))
	}
	n.releaseMounts()
	os.RemoveAll(n.dir)
}

// podState is the static pod's container state as the kubelet reports it on /pods: "Running",
// the reason it waits (ErrImageNeverPull), "Terminated", or "absent".
func (n *node) podState() string { return n.podStateOf(podName) }

// podStateOf is podState of the static pod whose manifest names it name.
func (n *node) podStateOf(name string) string {
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
		if pod.Name != name+"-"+nodeName {
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
func (n *node) pressure() string { return n.fill(evictionThreshold - 20<<20) }

// pinLabels lists every reference in containerd that carries a pin label, with its labels.
func (n *node) pinLabels() []string {
	all, err := n.client.ImageService().List(n.ctx)
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, img := range all {
		if img.Labels[pinning.LabelPinned] != "" {
			out = append(out, fmt.Sprintf("%s %v (updated %s)", img.Name, img.Labels, img.UpdatedAt.Format(time.RFC3339Nano)))
		}
	}
	return out
}

// stripPins removes every pin label from every image: a runtime that lost them.
func (n *node) stripPins() {
	if err := containerdtest.StripPins(n.ctx, n.client.ImageService()); err != nil {
		n.t.Fatal(err)
	}
}
