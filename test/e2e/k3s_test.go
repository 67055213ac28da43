package e2e_test

// A real k3s node: the k3s binary that make k3s built with k3s-pinning in it (K3S_E2E_BIN, its
// bin dir), run as `k3s server` on a single node (sqlite; the bundled components that need images
// disabled; no CNI, so pods use the host network and tolerate the not-ready taint), its containerd
// root on a loop-mounted ext4. Each scenario runs twice, with pinning and with
// --disable-image-pinning (stock k3s), and prints one table for both.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/distribution/reference"
	corev1 "k8s.io/api/core/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// k3s's containerd socket and state: fixed paths, whatever --data-dir says.
const (
	k3sContainerdSocket = "/run/k3s/containerd/containerd.sock"
	k3sRunDir           = "/run/k3s"
)

// k3sHostPaths are the paths outside its data dir that a k3s server creates here (seen on these
// VMs): its state under /run, the node password, the kubeconfig link, the kubelet's device-plugin
// dir and pod logs. The cleanup removes those that did not exist before the node started.
var k3sHostPaths = []string{k3sRunDir, "/etc/rancher/k3s", "/etc/rancher/node", "/etc/rancher", "/var/lib/kubelet", "/var/log/pods", "/var/log/containers"}

// The k3s node's images: the pause image under k3s's default name (the k3s 2961 report's case),
// the app a Deployment runs, a tool nobody runs; hand imports: one nobody wants, and one named by
// --pinned-images for each way of giving it (command line, config.yaml, K3S_PINNED_IMAGES).
const (
	k3sAppRef     = "airgap.example/k3s/app:1.0"
	k3sToolRef    = "airgap.example/k3s/tool:1.0"
	handCLIRef    = "registry.example/hand/cli:1.0"
	handConfigRef = "registry.example/hand/config:1.0"
	handEnvRef    = "registry.example/hand/env:1.0"
	// workloadRef is imported by hand and named by nothing but a Deployment scaled to 0
	// (--pinned-workload-images).
	workloadRef = "registry.example/hand/workload:1.0"
	parkedName  = "parked"
	// k3sLateRef comes in an archive copied into agent/images while k3s runs.
	k3sLateRef     = "airgap.example/k3s/late:1.0"
	k3sLateArchive = "late.tar"

	k3sNodeName = "k3s-e2e"
	k3sAppName  = "airgap-app"
	// k3sImagefsSize holds the images (the air-gap ones and five 32 MiB hand imports, with their
	// snapshots) and the pressure file; the kubelet's imagefs.available threshold is
	// evictionThreshold, as on the e2e node. At 480 MiB the fifth hand import alone crossed the
	// threshold: the kubelet reclaimed before the test's own pressure; at 576 MiB k3s v1.36 did
	// too (its kubelet removed the five unpinned hand imports right after the first start).
	k3sImagefsSize = 704 << 20
)

var (
	// k3sPauseRef is the pause image under the k3s line's default name (--pause-image; 3.6 up to
	// 1.34.3, 3.10.2 on the 2026 lines), the k3s 2961 report's case; k3sBinDir reads it.
	k3sPauseRef   string
	k3sAirgapRefs []string
	k3sHandRefs   = []string{unwantedRef, handCLIRef, handConfigRef, handEnvRef, workloadRef}
)

// pauseDefault is the default of --pause-image in `k3s server --help`.
var pauseDefault = regexp.MustCompile(`--pause-image value .*\(default: "([^"]+)"\)`)

// k3sBinDir is make k3s's bin dir (k3s, its multicall links, the containerd shim). It reads the
// line's default pause image from the binary.
func k3sBinDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("K3S_E2E_BIN")
	if dir == "" {
		t.Skip("*** SKIPPED: K3S_E2E_BIN is not set: make k3s-e2e (and make test) build k3s from ../shared/k3s-src and set it ***")
	}
	if _, err := os.Stat(filepath.Join(dir, "k3s")); err != nil {
		t.Fatalf("K3S_E2E_BIN=%s: %v", dir, err)
	}
	help, _ := exec.Command(filepath.Join(dir, "k3s"), "server", "--help").CombinedOutput()
	m := pauseDefault.FindSubmatch(help)
	if m == nil {
		t.Fatalf("k3s server --help names no default --pause-image:\n%s", tail(string(help), 5))
	}
	named, err := reference.ParseNormalizedNamed(string(m[1]))
	if err != nil {
		t.Fatalf("the default --pause-image %q: %v", m[1], err)
	}
	k3sPauseRef = named.String()
	k3sAirgapRefs = []string{k3sPauseRef, k3sAppRef, k3sToolRef}
	return dir
}

// k3sServer is the single `k3s server` node of make k3s-e2e and make bench, on this host: the
// shared k3sNode, and kubectl with its kubeconfig.
type k3sServer struct {
	*k3sNode
	kubectlRunner
}

func newK3sNode(t *testing.T, bin string, withPinning bool) *k3sServer {
	t.Helper()
	n := newK3sHost(t, bin, withPinning, k3sImagefsSize)
	hand := n.writeArchives(imageSet{pause: k3sPauseRef, app: k3sAppRef, tool: k3sToolRef, hand: k3sHandRefs}, n.imagesDir, filepath.Join(n.dir, "hand"), testBinary(t, "sleeper"))
	for i, ref := range k3sHandRefs {
		n.hand[ref] = hand[i]
	}
	// k3s keeps its import cache across restarts once this file exists (k3s issue 14265).
	if err := os.WriteFile(filepath.Join(n.imagesDir, ".cache.json"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return n
}

// newK3sHost is a k3s node's dirs, its imagefs of imagefsSize bytes mounted, k3s's containerd
// template and the kubelet drop-in written, and nothing in agent/images yet.
func newK3sHost(t *testing.T, bin string, withPinning bool, imagefsSize int64) *k3sServer {
	t.Helper()
	requireTools(t)
	if conn, err := os.Stat(k3sContainerdSocket); err == nil && conn.Mode()&os.ModeSocket != 0 {
		if out, _ := exec.Command("pgrep", "-f", "k3s server").Output(); len(out) > 0 {
			t.Fatalf("a k3s server is already running on this machine (%s): the e2e needs k3s's fixed paths", strings.TrimSpace(string(out)))
		}
	}
	created := absentPaths(k3sHostPaths...) // the cleanup removes them
	dir, err := os.MkdirTemp("", "k3s-pinning-k3s-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(dir, "data")
	n := &k3sServer{k3sNode: &k3sNode{
		host:      &host{t: t, ctx: namespaces.WithNamespace(t.Context(), pinning.DefaultNamespace), dir: dir, imagefs: filepath.Join(data, "agent", "containerd")},
		bin:       bin,
		name:      k3sNodeName,
		pinning:   withPinning,
		data:      data,
		imagesDir: filepath.Join(data, "agent", "images"),
		hand:      map[string]string{},
	}}
	n.kubectlRunner = kubectlRunner{kt: t, command: func(args ...string) *exec.Cmd {
		return exec.Command(filepath.Join(n.bin, "kubectl"), append([]string{"--kubeconfig", filepath.Join(n.dir, "kubeconfig")}, args...)...)
	}}
	t.Cleanup(func() { n.cleanup(created) })
	n.mountImagefs(imagefsSize)
	n.writeFile(filepath.Join(data, "agent", "etc", "containerd", "config-v3.toml.tmpl"), k3sContainerdTemplate)
	n.writeFile(filepath.Join(data, "agent", "etc", "kubelet.conf.d", "50-k3s-pinning-e2e.conf"), fmt.Sprintf(k3sKubeletDropIn, evictionThreshold>>20))
	return n
}

// k3sContainerdTemplate is k3s's containerd config for this VM: as k3s's own v3 template, with
// restrict_oom_score_adj (runc cannot write oom_score_adj without CAP_SYS_RESOURCE here) and NRI
// off (see ../shared/reference/e2e-diskpressure).
const k3sContainerdTemplate = `version = 3
root = {{ printf "%q" .NodeConfig.Containerd.Root }}
state = {{ printf "%q" .NodeConfig.Containerd.State }}

[grpc]
  address = {{ deschemify .NodeConfig.Containerd.Address | printf "%q" }}

[plugins.'io.containerd.internal.v1.opt']
  path = {{ printf "%q" .NodeConfig.Containerd.Opt }}

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "10010"

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  disable_snapshot_annotations = true

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{{ .NodeConfig.AgentConfig.PauseImage }}"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  SystemdCgroup = {{ .SystemdCgroup }}

[plugins.'io.containerd.cri.v1.images'.registry]
  config_path = {{ printf "%q" .NodeConfig.Containerd.Registry }}
`

// k3sKubeletDropIn is a kubelet config drop-in beside k3s's own: cgroup v1 allowed (this VM), and
// an imagefs eviction threshold that dd can cross on the small loop device.
const k3sKubeletDropIn = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%%"
  nodefs.inodesFree: "1%%"
  imagefs.available: "%dMi"
  imagefs.inodesFree: "1%%"
evictionPressureTransitionPeriod: 5s
imageMinimumGCAge: 1s
`

// k3sServerArgs are the arguments of every start: a single node whose bundled components that need
// images are off (their images are not in the images dir), no CNI, kubelet state in the test dir.
func (n *k3sServer) k3sServerArgs() []string {
	args := []string{"server", "--data-dir", n.data, "--node-name", k3sNodeName,
		"--write-kubeconfig", filepath.Join(n.dir, "kubeconfig"), "--write-kubeconfig-mode", "0600",
		"--disable", "traefik,servicelb,metrics-server,coredns,local-storage",
		"--disable-network-policy", "--disable-kube-proxy", "--disable-cloud-controller", "--disable-helm-controller",
		"--flannel-backend", "none", "--kubelet-arg", "root-dir=" + filepath.Join(n.dir, "kubelet"),
		// No pull ever leaves the machine: every registry is mirrored to a closed loopback port,
		// without containerd's fallback to the registry itself (a sandbox whose pause image is
		// gone, with stock k3s, makes the kubelet pull it).
		"--private-registry", n.registries(), "--disable-default-registry-endpoint"}
	if !n.pinning {
		args = append(args, "--disable-image-pinning")
	}
	return args
}

// registries writes the node's registries.yaml: every registry mirrored to 127.0.0.1:9, where
// nothing listens.
func (n *k3sServer) registries() string {
	path := filepath.Join(n.dir, "registries.yaml")
	if _, err := os.Stat(path); err != nil {
		n.writeFile(path, "mirrors:\n  \"*\":\n    endpoint:\n      - \"http://127.0.0.1:9\"\n")
	}
	return path
}

// start runs `k3s server` with the common arguments and extra, with env added, and waits until
// the node is registered, containerd answers, and agent/images is loaded.
func (n *k3sServer) start(extra []string, env ...string) {
	n.startAndWait(true, extra, env...)
}

// restart stops k3s and starts it again; with imagesBack false (stock k3s, whose images may be gone
// by then) it does not wait for agent/images to be present.
func (n *k3sServer) restart(imagesBack bool, extra []string, env ...string) {
	n.t.Helper()
	n.stop()
	n.startAndWait(imagesBack, extra, env...)
}

func (n *k3sServer) startAndWait(imagesLoaded bool, extra []string, env ...string) {
	n.t.Helper()
	if n.pinning {
		// Every start with pinning keeps the images of the workloads in "default" too.
		env = append([]string{"K3S_PINNED_WORKLOAD_IMAGES=true", "K3S_PINNED_WORKLOAD_NAMESPACES=default"}, env...)
	}
	n.launch(append(n.k3sServerArgs(), extra...), env...)
	n.awaitContainerd(3 * time.Minute)
	n.await(3*time.Minute, "the node registered", func() bool { return n.kubectlOK("get", "node", k3sNodeName) })
	if !imagesLoaded {
		return
	}
	n.await(2*time.Minute, "agent/images loaded", func() bool {
		got := n.present(k3sAirgapRefs...)
		return got[k3sPauseRef] && got[k3sAppRef] && got[k3sToolRef]
	})
}

// cleanup stops everything the node started, whatever state the test left it in: the pods (their
// shims), k3s and its containerd, the mounts below the test dir and /run/k3s, the loop device,
// the kubelet's cgroups, and the host paths k3s created (those in created), the app's pod logs.
func (n *k3sServer) cleanup(created []string) {
	if n.stopEvents != nil {
		n.stopEvents()
	}
	if n.cmd == nil && n.client == nil {
		if _, err := os.Stat(k3sContainerdSocket); err == nil {
			n.connect(k3sContainerdSocket)
		}
	}
	n.stopPods()
	if n.t.Failed() && n.log != "" {
		n.t.Logf("k3s log (%s), last lines:\n%s", n.log, lastLines(n.log, 60))
		for _, log := range n.logs {
			data, _ := os.ReadFile(log)
			var ours []string // k3s's logrus lines, where k3s-pinning's are (not the kubelet's klog ones)
			for _, line := range strings.Split(string(data), "\n") {
				if strings.HasPrefix(line, "time=") && !strings.Contains(line, "msg=\"Running ") {
					ours = append(ours, line)
				}
			}
			n.t.Logf("the logrus lines of %s (k3s-pinning's among them):\n%s", log, tail(strings.Join(ours, "\n"), 120))
		}
	}
	if n.cmd != nil {
		containerdtest.Terminate(n.cmd.Process, n.exited, 30*time.Second)
	}
	if n.client != nil {
		n.client.Close()
	}
	// Shims of pods that outlived k3s (k3s leaves them running by design: k3s-killall.sh stops them).
	exec.Command("pkill", "-9", "-f", "containerd-shim-runc-v2 -namespace k8s.io .* -address "+k3sContainerdSocket).Run()
	containerdtest.UnmountUnder(k3sRunDir)
	n.releaseMounts()
	for _, p := range created {
		os.RemoveAll(p)
	}
	for _, pattern := range []string{"/var/log/pods/default_" + k3sAppName + "-*", "/var/log/containers/" + k3sAppName + "-*"} {
		logs, _ := filepath.Glob(pattern)
		for _, p := range logs {
			os.RemoveAll(p)
		}
	}
	os.RemoveAll(n.dir)
}

// deployApp runs the app as a Deployment (so that an evicted pod is replaced): host network, the
// image from the images dir only (imagePullPolicy: Never), tolerating the not-ready taint of a
// node without CNI.
func (n *k3sServer) deployApp() {
	n.t.Helper()
	n.await(2*time.Minute, "the default service account (kubectl apply needs it for pods)", func() bool { return n.kubectlOK("get", "serviceaccount", "default") })
	n.applyDeployment(k3sAppName, k3sAppRef, 1)
}

// applyDeployment applies a Deployment of replicas pods running image (host network, from the
// node only: imagePullPolicy Never, tolerating the not-ready taint of a node without CNI).
func (n *k3sServer) applyDeployment(name, image string, replicas int) {
	n.t.Helper()
	manifest := fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: %[1]s, namespace: default}
spec:
  replicas: %[3]d
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
      hostNetwork: true
      terminationGracePeriodSeconds: 1
      tolerations: [{key: node.kubernetes.io/not-ready, operator: Exists}]
      containers:
      - {name: main, image: %[2]s, imagePullPolicy: Never}
`, name, image, replicas)
	path := filepath.Join(n.dir, name+".yaml")
	n.writeFile(path, manifest)
	n.mustKubectl("apply", "-f", path)
}

// appPods summarizes the app's pods as kubectl shows them: "Running", the reason a container
// waits (ErrImageNeverPull), "Evicted", "Pending".
func (n *k3sServer) appPods() []string {
	out, err := n.kubectl("get", "pods", "-l", "app="+k3sAppName, "-o", "json")
	if err != nil {
		return []string{"kubectl: " + strings.TrimSpace(out)}
	}
	var pods corev1.PodList
	if err := json.Unmarshal([]byte(out), &pods); err != nil {
		return []string{"bad pod list: " + err.Error()}
	}
	var states []string
	for _, pod := range pods.Items {
		state := string(pod.Status.Phase)
		if pod.Status.Reason != "" {
			state = pod.Status.Reason
		}
		for _, c := range pod.Status.ContainerStatuses {
			switch {
			case c.State.Running != nil:
				state = "Running"
			case c.State.Waiting != nil && c.State.Waiting.Reason != "":
				state = c.State.Waiting.Reason
			}
		}
		states = append(states, state)
	}
	slices.Sort(states)
	return states
}

func (n *k3sServer) appRunning() bool { return slices.Contains(n.appPods(), "Running") }

// digest is the manifest digest containerd holds for ref, or "".
func (n *k3sServer) digest(ref string) string {
	img, err := n.client.ImageService().Get(n.ctx, ref)
	if err != nil {
		return ""
	}
	return img.Target.Digest.String()
}

// k3sReport is one mode's column of the table.
type k3sReport struct {
	afterStart          map[string]bool // CRI pinned after the first start (air-gap and hand imports)
	afterRestart        map[string]bool // CRI pinned after the restart with .cache.json
	presentAfterRestart map[string]bool // present a minute after the restart
	appAfterRestart     string          // the app's pods a minute after the restart
	seenUnpinned        []string        // air-gap images containerd's events showed unpinned across the restart(s)
	evicted             bool            // the app's pod was evicted under pressure
	evictionActed       bool            // the kubelet's eviction manager acted on the pressure (reclaim, then evict)
	afterPressure       map[string]bool // present after the kubelet's reclaim
	appAfter            string          // the app's pods once the pressure is gone
	rmiBack             string          // 2961: the pause image after crictl rmi
	policy              map[string]bool // pinned: the hand import named each way
	doctorExit          int
	reclaimDuration     time.Duration
	// the cluster view (pinning mode; stock k3s: status --cluster only)
	restoredEvent, lostEvent, lostCondition string
	workloadDenied                          string // the Event, or NONE
	clusterExit                             []int  // status --cluster: protected, after a loss, back
	// at runtime, after the pressure
	strippedBack string // the app image's CRI pin label removed by hand
	lateAdded    string // an archive copied into agent/images
	toolRemoved  string // tools.tar.zst removed from agent/images: its image's pin
}

func yesNo(b bool, yes, no string) string {
	if b {
		return yes
	}
	return no
}

// printK3sTable prints one table for both modes; a mode that did not run (make test runs the
// second k3s line with k3s-pinning only) is a column of "not run".
func printK3sTable(with, stock *k3sReport) {
	var b strings.Builder
	cell := func(r *k3sReport, f func(*k3sReport) string) string {
		if r == nil {
			return "not run"
		}
		return f(r)
	}
	const format = "%-72s %-28s %-28s\n"
	row := func(what string, f func(*k3sReport) string) {
		fmt.Fprintf(&b, format, what, cell(with, f), cell(stock, f))
	}
	// withOnly: a row only the pinning mode has (stock k3s has no such feature).
	withOnly := func(what string, f func(*k3sReport) string) { fmt.Fprintf(&b, format, what, cell(with, f), "-") }
	b.WriteString("\n---- k3s e2e: the patched k3s, with k3s-pinning and with --disable-image-pinning (stock k3s)\n")
	fmt.Fprintf(&b, format, "", "WITH K3S-PINNING", "--disable-image-pinning")
	for _, ref := range k3sAirgapRefs {
		row("pinned after first start: "+ref, func(r *k3sReport) string { return yesNo(r.afterStart[ref], "pinned", "UNPINNED") })
	}
	row("2961 pause image after crictl rmi", func(r *k3sReport) string { return r.rmiBack })
	for _, ref := range k3sAirgapRefs {
		row("14265 pinned after restart (.cache.json): "+ref, func(r *k3sReport) string { return yesNo(r.afterRestart[ref], "pinned", "UNPINNED") })
	}
	row("14265 air-gap images seen unpinned across the restart (events)", func(r *k3sReport) string { return fmt.Sprint(len(r.seenUnpinned)) })
	for _, ref := range k3sAirgapRefs {
		row("14265 present a minute after the restart: "+ref, func(r *k3sReport) string { return yesNo(r.presentAfterRestart[ref], "present", "DELETED") })
	}
	row("14265 app pods a minute after the restart", func(r *k3sReport) string { return r.appAfterRestart })
	row("10209 pressure to the unwanted image reclaimed", func(r *k3sReport) string { return r.reclaimDuration.Round(100 * time.Millisecond).String() })
	row("10209 app pod evicted under disk pressure", func(r *k3sReport) string { return yesNo(r.evicted, "evicted", "not evicted") })
	for _, ref := range append(slices.Clone(k3sAirgapRefs), unwantedRef, workloadRef) {
		row("10209 present after the kubelet's reclaim: "+ref, func(r *k3sReport) string { return yesNo(r.afterPressure[ref], "present", "DELETED") })
	}
	withOnly("--pinned-workload-images without its ClusterRole", func(r *k3sReport) string { return yesNo(r.workloadDenied != "", "WorkloadAccessDenied", "NONE") })
	row("10209 app pods after the pressure", func(r *k3sReport) string { return r.appAfter })
	for _, way := range []string{"command line", "config.yaml", "K3S_PINNED_IMAGES"} {
		row("hand import named by --pinned-images ("+way+")", func(r *k3sReport) string {
			return yesNo(r.policy[way], "pinned", yesNo(r == with, "UNPINNED", "UNPINNED (no such flag)"))
		})
	}
	row("CRI pin label stripped from the app image", func(r *k3sReport) string { return r.strippedBack })
	row("archive copied into agent/images at runtime", func(r *k3sReport) string { return r.lateAdded })
	row("archive removed from agent/images: its image's pin", func(r *k3sReport) string { return r.toolRemoved })
	withOnly("k3s-pinning doctor exit code", func(r *k3sReport) string { return fmt.Sprint(r.doctorExit) })
	withOnly("Node event after the pause image's restore", func(r *k3sReport) string { return yesNo(r.restoredEvent != "", "ImageRestored", "NONE") })
	withOnly("Node event after a hand import's loss", func(r *k3sReport) string { return yesNo(r.lostEvent != "", "ImageLost", "NONE") })
	withOnly("node condition after the loss", func(r *k3sReport) string { return strings.SplitN(r.lostCondition, ":", 2)[0] })
	row("status --cluster exit: protected, lost, back", func(r *k3sReport) string { return fmt.Sprint(r.clusterExit) })
	fmt.Fprint(os.Stdout, b.String())
}

// pressureEvictReclaim is k3s issue 10209: the imagefs is filled past the eviction threshold by
// more than the unpinned images can free, so the kubelet reclaims every image it may and evicts
// the app's pod; then the pressure goes, and the Deployment's new pod must start from the image.
// It records what happened; the caller asserts what its mode promises.
func (n *k3sServer) pressureEvictReclaim(r *k3sReport) {
	n.t.Helper()
	wasRunning := n.appRunning()
	start := time.Now()
	logStart := fileSize(n.log)
	release := n.fill(evictionThreshold - 100<<20)
	n.await(3*time.Minute, "the kubelet reclaiming the unwanted image under disk pressure", func() bool { return !n.present(unwantedRef)[unwantedRef] })
	r.reclaimDuration = time.Since(start)
	if wasRunning {
		deadline := time.Now().Add(2 * time.Minute)
		for time.Now().Before(deadline) && !r.evicted {
			r.evicted = slices.Contains(n.appPods(), "Evicted")
			time.Sleep(time.Second)
		}
	}
	time.Sleep(15 * time.Second) // the reclaim after the eviction (the app's image is unused then)
	// The eviction manager acting on this pressure: it evicts the app's pod, or (seen once after a
	// restart, with the app Running) finds "no pods are active to evict"; either way it has reclaimed
	// images first (DeleteUnusedImages), which is what the images must survive.
	if data, err := os.ReadFile(n.log); err == nil && int64(len(data)) > logStart {
		r.evictionActed = r.evicted || strings.Contains(string(data[logStart:]), "Eviction manager: must evict pod(s) to reclaim")
	}
	r.afterPressure = n.present(append(slices.Clone(k3sAirgapRefs), unwantedRef, workloadRef)...)
	if err := os.Remove(release); err != nil {
		n.t.Fatal(err)
	}
	// Running again, or stuck without its image: ErrImageNeverPull, or a sandbox that cannot start
	// without the pause image (ContainerCreating).
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) && !n.appRunning() {
		time.Sleep(time.Second)
	}
	r.appAfter = strings.Join(slices.Compact(n.appPods()), ",")
}

// rmiPause is k3s issue 2961: `crictl rmi` of the pause image; it must come back from its archive
// with the same digest (with k3s-pinning), where stock k3s leaves it gone until a restart.
func (n *k3sServer) rmiPause(r *k3sReport) {
	n.t.Helper()
	want := n.digest(k3sPauseRef)
	if want == "" {
		r.rmiBack = "absent before rmi"
		return
	}
	n.mustTool("crictl", "--runtime-endpoint", "unix://"+k3sContainerdSocket, "rmi", k3sPauseRef)
	start := time.Now()
	deadline := 30 * time.Second
	for time.Since(start) < deadline {
		if got := n.digest(k3sPauseRef); got != "" {
			r.rmiBack = fmt.Sprintf("back in %.1f s, %s", time.Since(start).Seconds(), yesNo(got == want, "same digest", "OTHER DIGEST "+got))
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	r.rmiBack = fmt.Sprintf("GONE after %s", deadline)
}

// TestK3sNode runs the scenarios on the patched k3s, with pinning and without.
func TestK3sNode(t *testing.T) {
	bin := k3sBinDir(t)
	// Each subtest fills its column, also when it fails; they run one after the other, and -run may
	// choose one.
	var with, stock *k3sReport
	t.Run("with-k3s-pinning", func(t *testing.T) { runK3sScenarios(t, bin, true, &with) })
	t.Run("disable-image-pinning", func(t *testing.T) { runK3sScenarios(t, bin, false, &stock) })
	if with != nil || stock != nil {
		printK3sTable(with, stock)
	}
}

// runK3sScenarios runs every scenario in one mode; *report is its column of the table.
func runK3sScenarios(t *testing.T, bin string, withPinning bool, report **k3sReport) {
	n := newK3sNode(t, bin, withPinning)
	r := &k3sReport{policy: map[string]bool{}}
	defer func() { *report = r }()

	// First start; the hand imports come after it, as an operator's would.
	var extra []string
	if withPinning {
		extra = []string{"--pinned-images", handCLIRef}
	}
	n.start(extra)
	n.handImport()
	if withPinning {
		n.await(30*time.Second, "the hand import named on the command line pinned", func() bool { return n.criPinned(handCLIRef) })
		r.policy["command line"] = true
		if n.criPinned(handConfigRef) || n.criPinned(handEnvRef) {
			t.Errorf("hand imports no flag names are pinned")
		}
	} else {
		// Stock k3s has no such flag: what it does with the same hand imports.
		time.Sleep(5 * time.Second)
		r.policy["command line"], r.policy["config.yaml"], r.policy["K3S_PINNED_IMAGES"] = n.criPinned(handCLIRef), n.criPinned(handConfigRef), n.criPinned(handEnvRef)
	}
	n.deployApp()
	n.await(3*time.Minute, "the app's pod Running", n.appRunning)
	n.parkWorkload(r)
	r.afterStart = n.pins(append(slices.Clone(k3sAirgapRefs), k3sHandRefs...)...)
	if withPinning {
		for _, ref := range k3sAirgapRefs {
			if !r.afterStart[ref] {
				t.Errorf("%s not pinned after the first start", ref)
			}
		}
	}

	// k3s 2961: crictl rmi of the pause image, which nothing uses as an image (the running sandbox
	// does not need it). Before the restart, so that the restart shows whether stock k3s brings it
	// back.
	n.rmiPause(r)
	if withPinning && !strings.HasPrefix(r.rmiBack, "back in") {
		t.Errorf("2961: the pause image is %s after crictl rmi", r.rmiBack)
	}
	if withPinning {
		// The restore as an Event on the Node, before the restart below: events still queued in a
		// process that stops are lost (the kubelet's too).
		n.await(time.Minute, "an ImageRestored event on the Node naming the pause image", func() bool { return n.nodeEvent("ImageRestored", k3sPauseRef) != "" })
		r.restoredEvent = n.nodeEvent("ImageRestored", k3sPauseRef)
	}

	// k3s 14265: restart with .cache.json. With pinning, this start names the hand import in
	// config.yaml (the command line's is no longer named).
	extra = nil
	if withPinning {
		n.writeFile(filepath.Join(n.dir, "config.yaml"), "pinned-images:\n  - "+handConfigRef+"\n")
		extra = []string{"--config", filepath.Join(n.dir, "config.yaml")}
	}
	// Both modes: every air-gap image that containerd's events show unpinned while k3s restarts
	// (stock k3s clears its pins at start and, since k3s PR 14266, labels an unchanged file's
	// images again by the names .cache.json recorded).
	n.watchPins(func() string { return k3sContainerdSocket }, k3sAirgapRefs)
	n.restart(withPinning, extra)
	time.Sleep(5 * time.Second) // k3s's own import and clearing of pins, if any, run after containerd starts
	if !withPinning {
		// Give stock k3s's re-labelling its time: every air-gap image it still holds pinned again.
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) && !n.presentArePinned(k3sAirgapRefs...) {
			time.Sleep(time.Second)
		}
		n.stopEvents()
		n.stopEvents = nil
		r.seenUnpinned = slices.Clone(n.seenUnpinned)
	}
	r.afterRestart = n.pins(k3sAirgapRefs...)
	if withPinning {
		n.await(30*time.Second, "the hand import named in config.yaml pinned", func() bool { return n.criPinned(handConfigRef) })
		r.policy["config.yaml"] = true
		if log, _ := os.ReadFile(n.log); strings.Contains(string(log), "Unknown flag") {
			t.Errorf("k3s server skipped a config.yaml key: %s", tail(grepLines(string(log), "Unknown flag"), 3))
		}
		for _, ref := range k3sAirgapRefs {
			if !r.afterRestart[ref] {
				t.Errorf("14265: %s unpinned after the restart", ref)
			}
		}
		// Once more, the policy as K3S_PINNED_IMAGES.
		n.restart(true, nil, "K3S_PINNED_IMAGES="+handEnvRef)
		n.await(30*time.Second, "the hand import named by K3S_PINNED_IMAGES pinned", func() bool { return n.criPinned(handEnvRef) })
		r.policy["K3S_PINNED_IMAGES"] = true
		n.stopEvents()
		n.stopEvents = nil
		r.seenUnpinned = slices.Clone(n.seenUnpinned)
		if len(r.seenUnpinned) > 0 {
			t.Errorf("14265: containerd's events showed air-gap images unpinned across the restarts: %v", r.seenUnpinned)
		}
		r.doctorExit = n.doctor(handEnvRef)
		if r.doctorExit != 0 {
			t.Errorf("k3s-pinning doctor against the node exited %d", r.doctorExit)
		}
	}
	if withPinning {
		n.await(3*time.Minute, "the app's pod Running after the restart", n.appRunning)
	} else {
		// Stock k3s may have lost the images by now (14265): record, do not wait for ever.
		deadline := time.Now().Add(time.Minute)
		for time.Now().Before(deadline) && !n.appRunning() {
			time.Sleep(time.Second)
		}
	}
	r.appAfterRestart = strings.Join(slices.Compact(n.appPods()), ",")
	r.presentAfterRestart = n.present(k3sAirgapRefs...)

	// k3s 10209 (and 14265's consequence for stock k3s): pressure.
	n.pressureEvictReclaim(r)
	if withPinning {
		for _, ref := range k3sAirgapRefs {
			if !r.afterPressure[ref] {
				t.Errorf("10209: air-gap image %s deleted under pressure", ref)
			}
		}
		if !r.evictionActed {
			t.Errorf("10209: the pressure did not reach the kubelet's eviction manager (the app's pod not evicted, and no \"must evict\" in the log)")
		}
		if !slices.Contains(n.appPods(), "Running") {
			t.Errorf("10209: the app is not Running again after the pressure: %v", n.appPods())
		}
	}
	if r.afterPressure[unwantedRef] {
		t.Errorf("the unwanted hand import survived: the kubelet's reclaim did not run")
	}
	if withPinning && !r.afterPressure[workloadRef] {
		t.Errorf("--pinned-workload-images: %s, the image of a Deployment scaled to 0, deleted under pressure", workloadRef)
	}
	if !withPinning && r.afterPressure[workloadRef] {
		t.Errorf("without --pinned-workload-images, %s (unused: its Deployment is scaled to 0) survived the reclaim", workloadRef)
	}
	n.runtimeChanges(r)
	if withPinning {
		for what, got := range map[string]string{"the stripped pin label": r.strippedBack, "the archive added at runtime": r.lateAdded} {
			if !strings.HasPrefix(got, "pinned in") {
				t.Errorf("%s: %s", what, got)
			}
		}
		if !strings.HasPrefix(r.toolRemoved, "released in") {
			t.Errorf("the archive removed at runtime: its image %s", r.toolRemoved)
		}
	}
	if withPinning {
		n.clusterView(r, handEnvRef)
	} else {
		// No k3s-pinning: no condition on the node, and status --cluster says so.
		out, code := n.statusCluster()
		r.clusterExit = []int{code}
		if code != 1 || !strings.Contains(out, "NoReport") {
			t.Errorf("status --cluster without k3s-pinning: exit %d, want 1 with NoReport\n%s", code, out)
		}
	}

}

// labelPinned says whether containerd's record of ref carries the CRI pin label (what the CRI's
// view, which lags it by a moment, follows).
func (n *k3sServer) labelPinned(ref string) bool {
	img, err := n.client.ImageService().Get(n.ctx, ref)
	return err == nil && img.Labels[pinning.LabelPinned] == pinning.PinnedValue
}

// presentArePinned says whether every one of refs that containerd holds is CRI pinned.
func (n *k3sServer) presentArePinned(refs ...string) bool {
	for ref, present := range n.present(refs...) {
		if present && !n.criPinned(ref) {
			return false
		}
	}
	return true
}

// runtimeChanges are what an operator (or a script) does to a running node: the CRI pin label
// stripped from an image by hand, an archive copied into agent/images, an archive removed from it.
// It records, per change, what the node did within 30 s, read from containerd's labels (the CRI's
// view follows them; on containerd 2.3 it was seen to keep showing a stripped image pinned).
func (n *k3sServer) runtimeChanges(r *k3sReport) {
	n.t.Helper()
	within := func(what string, cond func() bool) string {
		start := time.Now()
		for time.Since(start) < 30*time.Second {
			if cond() {
				return fmt.Sprintf("%s in %.1f s", what, time.Since(start).Seconds())
			}
			time.Sleep(100 * time.Millisecond)
		}
		return ""
	}

	// The CRI pin label removed from the app's image (a typo'd script, an operator's cleanup).
	img, err := n.client.ImageService().Get(n.ctx, k3sAppRef)
	if err != nil {
		n.t.Fatalf("the app image before the strip: %v", err)
	}
	delete(img.Labels, pinning.LabelPinned)
	if _, err := n.client.ImageService().Update(n.ctx, img, "labels."+pinning.LabelPinned); err != nil {
		n.t.Fatal(err)
	}
	r.strippedBack = within("pinned", func() bool { return n.labelPinned(k3sAppRef) })
	if r.strippedBack == "" {
		r.strippedBack = "UNPINNED after 30 s"
	}

	// An archive copied in while k3s runs (written beside, then renamed in, as cp to a temporary
	// name and mv would).
	late, err := imagetest.Image(64<<10, imagetest.Amd64)
	if err != nil {
		n.t.Fatal(err)
	}
	tmp := filepath.Join(n.dir, k3sLateArchive) // the same filesystem as agent/images
	if err := imagetest.WriteOCI(tmp, map[string]any{k3sLateRef: late}); err != nil {
		n.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(n.imagesDir, k3sLateArchive)); err != nil {
		n.t.Fatal(err)
	}
	r.lateAdded = within("pinned", func() bool { return n.labelPinned(k3sLateRef) })
	if r.lateAdded == "" {
		r.lateAdded = yesNo(n.present(k3sLateRef)[k3sLateRef], "imported, UNPINNED after 30 s", "NOT IMPORTED after 30 s")
	}

	// The tool's archive removed (to save disk, or because the tool is retired): nothing wants its
	// image any more, so it should be the kubelet's to collect.
	if err := os.Remove(filepath.Join(n.imagesDir, toolArchive)); err != nil {
		n.t.Fatal(err)
	}
	r.toolRemoved = within("released", func() bool { return !n.labelPinned(k3sToolRef) })
	if r.toolRemoved == "" {
		r.toolRemoved = "still PINNED after 30 s"
	}
}

// grepLines is the lines of s that contain substr.
func grepLines(s, substr string) string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, substr) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

// k3sPinningBin is the k3s-pinning command (k3sPinningCLI).
func (n *k3sServer) k3sPinningBin() string { return k3sPinningCLI(n.t) }

// k3sPinningCLI is the k3s-pinning command of this checkout, built once per test binary into the
// user cache (beside testBinary's).
func k3sPinningCLI(t *testing.T) string {
	t.Helper()
	builtBinaries.Lock()
	defer builtBinaries.Unlock()
	if path, ok := builtBinaries.paths["k3s-pinning"]; ok {
		return path
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	root, err := containerdtest.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(cache, "k3s-pinning", "e2e", "k3s-pinning")
	build := exec.Command("go", "build", "-o", bin, "./cmd/k3s-pinning")
	build.Dir = root
	build.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/k3s-pinning: %v\n%s", err, out)
	}
	builtBinaries.paths["k3s-pinning"] = bin
	return bin
}

func (n *k3sServer) doctor(pinned string) int {
	n.t.Helper()
	out, code := n.k3sPinning("doctor", "--containerd-address", k3sContainerdSocket, "--images-dir", n.imagesDir,
		"--state-file", filepath.Join(n.data, "agent", "k3s-pinning", "state.json"), "--pinned-images", pinned)
	n.t.Logf("k3s-pinning doctor:\n%s", out)
	return code
}

// parkWorkload runs a Deployment scaled to 0 whose image was imported by hand and is named by
// nothing else. With pinning (and --pinned-workload-images, on every start here), the agent's
// kubelet credentials first may not read the workloads: a WorkloadAccessDenied Event says what is
// missing while the node-local protection goes on; once deploy/k3s-pinning-workloads.yaml binds
// its ClusterRole to the nodes in "default", the image is pinned for its workload.
func (n *k3sServer) parkWorkload(r *k3sReport) {
	n.t.Helper()
	if n.pinning {
		n.await(time.Minute, "a WorkloadAccessDenied event on the Node", func() bool { return n.nodeEvent("WorkloadAccessDenied", "ClusterRole") != "" })
		r.workloadDenied = n.nodeEvent("WorkloadAccessDenied", "ClusterRole")
		n.t.Logf("without the ClusterRole: %s", r.workloadDenied)
		if !strings.Contains(r.workloadDenied, "list and watch deployments.apps") || !strings.Contains(r.workloadDenied, "pods in default") {
			n.t.Errorf("the denial does not name what is missing: %s", r.workloadDenied)
		}
		if !n.criPinned(handCLIRef) || !n.criPinned(k3sAppRef) {
			n.t.Errorf("the node-local protection stopped while the workloads could not be read")
		}
		n.mustKubectl("apply", "-f", filepath.Join(repoRoot(n.t), "deploy", "k3s-pinning-workloads.yaml"))
	}
	n.applyDeployment(parkedName, workloadRef, 0)
	if n.pinning {
		n.await(2*time.Minute, workloadRef+" pinned for the Deployment scaled to 0", func() bool { return n.criPinned(workloadRef) })
	}
}

// condition is the node's AirgapImagesProtected condition as "status reason: message", or "".
func (n *k3sServer) condition() string {
	out, err := n.kubectl("get", "node", k3sNodeName, "-o", `jsonpath={range .status.conditions[?(@.type=="AirgapImagesProtected")]}{.status} {.reason}: {.message}{end}`)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// nodeEvent is the message of the node's first event with reason whose message names what, or "".
func (n *k3sServer) nodeEvent(reason, what string) string {
	out, err := n.kubectl("get", "events", "-A", "--field-selector", "involvedObject.kind=Node,involvedObject.name="+k3sNodeName+",reason="+reason,
		"-o", `jsonpath={range .items[*]}{.type} {.source.component}: {.message}{"\n"}{end}`)
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, what) {
			return line
		}
	}
	return ""
}

// clusterView checks what an operator sees through the API server: the node condition and
// status --cluster; then a loss (a hand import the
// policy keeps, deleted by hand: nothing can restore it) flips both, and importing it again
// flips them back.
func (n *k3sServer) clusterView(r *k3sReport, lost string) {
	n.t.Helper()
	n.await(time.Minute, "the node condition AirgapImagesProtected True", func() bool { return strings.HasPrefix(n.condition(), "True ") })
	out, code := n.statusCluster()
	n.t.Logf("k3s-pinning status --cluster (exit %d):\n%s", code, out)
	r.clusterExit = []int{code}
	if code != 0 || !strings.Contains(out, k3sNodeName) {
		n.t.Errorf("status --cluster on a protected node: exit %d\n%s", code, out)
	}

	n.ctr("images", "rm", lost)
	n.await(time.Minute, "an ImageLost event on the Node naming "+lost, func() bool { return n.nodeEvent("ImageLost", lost) != "" })
	r.lostEvent = n.nodeEvent("ImageLost", lost)
	n.await(time.Minute, "the node condition False, ImagesLost", func() bool { return strings.HasPrefix(n.condition(), "False ImagesLost") })
	r.lostCondition = n.condition()
	out, code = n.statusCluster()
	n.t.Logf("k3s-pinning status --cluster after the loss (exit %d):\n%s", code, out)
	r.clusterExit = append(r.clusterExit, code)
	if code != 1 || !strings.Contains(out, "ImagesLost") || !strings.Contains(out, lost) {
		n.t.Errorf("status --cluster after a loss: exit %d, want 1 naming ImagesLost and %s\n%s", code, lost, out)
	}
	events, _ := n.kubectl("get", "events", "--field-selector", "involvedObject.kind=Node,source="+"k3s-pinning")
	n.t.Logf("kubectl get events --field-selector involvedObject.kind=Node,source=k3s-pinning:\n%s", events)

	n.handImport()
	n.await(time.Minute, "the node condition True again once the image is imported again", func() bool { return strings.HasPrefix(n.condition(), "True ") })
	_, code = n.statusCluster()
	r.clusterExit = append(r.clusterExit, code)
	if code != 0 {
		n.t.Errorf("status --cluster once the image is back: exit %d, want 0", code)
	}
}

// TestK3sWrapperAcceptsTheFlags: the outer k3s wrapper (cmd/k3s, what a release ships as k3s)
// parses os.Args with k3s's server and agent commands before it extracts its data and execs the
// inner binary; flags it does not know stop it there ("flag provided but not defined").
func TestK3sWrapperAcceptsTheFlags(t *testing.T) {
	bin := k3sBinDir(t)
	for _, args := range [][]string{
		{"server", "--disable-image-pinning", "--disable-image-restore"},
		{"agent", "--pinned-images", handCLIRef, "--pinned-image-labels", "example.com/keep", "--pinned-workload-images",
			"--pinned-workload-namespaces", "default", "--pinned-workload-selector", "k3s-pinning.io/keep=true", "--max-workload-images", "5"},
	} {
		dataDir := t.TempDir()
		cmd := exec.Command(filepath.Join(bin, "k3s-wrapper"), append(args, "--data-dir", dataDir)...)
		out, _ := cmd.CombinedOutput()
		if strings.Contains(string(out), "flag provided but not defined") {
			t.Errorf("k3s %s: the wrapper refuses the flags:\n%s", strings.Join(args, " "), out)
		}
		// It got past flag parsing into its action, which extracts its data (empty here) to run the
		// inner binary: that is where it stops.
		if !strings.Contains(string(out), "main.stageAndRun") {
			t.Errorf("k3s %s: the wrapper did not get as far as extracting its data:\n%s", strings.Join(args, " "), out)
		}
		t.Logf("k3s %s (wrapper with empty data): parsed the flags, then %s", strings.Join(args, " "), strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0]))
	}
}

// TestK3sBadFlagValueStops: a malformed --pinned-images stops k3s with an error that names the
// flag, with pinning on, and with --disable-image-pinning too (where naming images to keep is an
// error, not silently ignored).
func TestK3sBadFlagValueStops(t *testing.T) {
	bin := k3sBinDir(t)
	for _, c := range []struct {
		pinning bool
		value   string
	}{{true, "registry.example/[bad"}, {false, handCLIRef}} {
		n := newK3sNode(t, bin, c.pinning)
		n.log = filepath.Join(n.dir, "k3s-bad.log")
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		cmd := exec.CommandContext(ctx, filepath.Join(bin, "k3s"), append(n.k3sServerArgs(), "--pinned-images", c.value)...)
		cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		cancel()
		os.WriteFile(n.log, out, 0o644)
		if err == nil {
			t.Errorf("k3s server --pinned-images %q (pinning %t) exited 0", c.value, c.pinning)
		}
		if strings.Contains(string(out), "Running containerd") {
			t.Errorf("k3s server --pinned-images %q (pinning %t) started containerd before refusing the value", c.value, c.pinning)
		}
		if !strings.Contains(string(out), "--pinned-images") {
			t.Errorf("k3s server --pinned-images %q (pinning %t): the error does not name the flag:\n%s", c.value, c.pinning, tail(string(out), 5))
		}
		t.Logf("pinning %t, --pinned-images %q: %s", c.pinning, c.value, tail(grepLines(string(out), "--pinned-images"), 1))
	}
}

// TestK3sStockNodeWithDaemon: the stock-node path of the cluster view. `k3s-pinning run` beside a
// k3s that does not have it built in (--disable-image-pinning), with the node's admin kubeconfig:
// it writes the node condition, status --cluster reads it, and --pinned-workload-images pins the
// hand-imported image of a Deployment scaled to 0.
func TestK3sStockNodeWithDaemon(t *testing.T) {
	bin := k3sBinDir(t)
	n := newK3sNode(t, bin, false)
	n.start(nil)
	n.handImport()
	n.parkWorkload(&k3sReport{})
	out, code := n.statusCluster()
	if code != 1 || !strings.Contains(out, "NoReport") {
		t.Errorf("status --cluster before k3s-pinning runs: exit %d, want 1 with NoReport\n%s", code, out)
	}
	logPath := filepath.Join(n.dir, "daemon.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	daemon := exec.Command(n.k3sPinningBin(), "run", "--containerd-address", k3sContainerdSocket, "--images-dir", n.imagesDir,
		"--state-file", filepath.Join(n.dir, "daemon-state", "state.json"), "--kubeconfig", filepath.Join(n.dir, "kubeconfig"),
		"--node-name", k3sNodeName, "--pinned-workload-images", "--pinned-workload-namespaces", "default")
	daemon.Stdout, daemon.Stderr = logFile, logFile
	daemon.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- daemon.Wait(); logFile.Close() }()
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			daemon.Process.Kill()
			<-exited
		}
		if t.Failed() {
			data, _ := os.ReadFile(logPath)
			t.Logf("k3s-pinning run's log:\n%s", tail(string(data), 40))
		}
	})
	n.await(time.Minute, "the node condition AirgapImagesProtected True from k3s-pinning run", func() bool { return strings.HasPrefix(n.condition(), "True ") })
	n.await(time.Minute, workloadRef+" pinned for the Deployment scaled to 0", func() bool { return n.criPinned(workloadRef) })
	for _, ref := range k3sAirgapRefs {
		if !n.criPinned(ref) {
			t.Errorf("%s not pinned by k3s-pinning run", ref)
		}
	}
	out, code = n.statusCluster()
	t.Logf("k3s-pinning status --cluster, k3s-pinning run beside stock k3s (exit %d):\n%s", code, out)
	if code != 0 {
		t.Errorf("status --cluster with k3s-pinning run: exit %d, want 0", code)
	}
	daemon.Process.Signal(syscall.SIGTERM)
	stopped = true
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("k3s-pinning run after SIGTERM: %v", err)
		}
	case <-time.After(30 * time.Second):
		daemon.Process.Kill()
		<-exited
		t.Errorf("k3s-pinning run did not stop within 30 s of SIGTERM")
	}
}

// fileSize is the size of path now, 0 if it cannot be read.
func fileSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}
