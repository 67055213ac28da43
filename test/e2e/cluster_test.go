package e2e_test

// A real k3s cluster on this one machine (make cluster-e2e): the k3s that make k3s built
// (K3S_E2E_BIN), one `k3s server` and two `k3s agent`s that join it with a token, twice: with
// k3s-pinning in k3s, and as stock k3s (--disable-image-pinning) protected by the DaemonSet of
// deploy/k3s-pinning.yaml. Each node runs in network and mount namespaces of its own: its eth0 on
// a bridge in a namespace the test makes (a LAN with no other link: no route leads out of it), and
// its own /run (k3s's containerd socket, flannel's subnet file, the pods' network namespaces),
// /var/lib/rancher/k3s (k3s's default data dir, which the DaemonSet's hostPaths name),
// /var/lib/kubelet, /var/log/pods, /etc/rancher (where an agent's config.yaml is) and /var/lib/cni;
// its kubelet has a cgroup root of its own and its containerd root is a loop-mounted ext4. The CNI is k3s's own flannel (host-gw),
// with the plugins and the iptables of build/cluster-tools.sh (K3S_CLUSTER_TOOLS), which only the
// nodes see, in their namespaces.

import (
	"encoding/json"
	"fmt"
	"maps"
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

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/platforms"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	corev1 "k8s.io/api/core/v1"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// The cluster's addresses: ranges used nowhere else on the machine, and only inside the test's
// namespaces. Nothing answers DNS (coredns is disabled; the nodes' resolv.conf names the LAN's
// bridge, where no server listens), so nothing is looked up outside.
const (
	clusterLAN   = "10.254.213" // .1 the LAN's bridge, .10 the server, .11 and .12 the agents
	clusterCIDR  = "10.254.128.0/20"
	serviceCIDR  = "10.254.144.0/24"
	clusterDNS   = "10.254.144.10"
	clusterToken = "k3s-pinning-cluster-e2e"

	clusterWebRef     = "airgap.example/cluster/web:1.0"
	clusterWebName    = "airgap-web"
	clusterWebPort    = 8080
	clusterRoleLabel  = "k3s-pinning.e2e/role"
	clusterWorkload   = "registry.example/hand/cluster-workload:1.0"
	clusterParkedName = "parked"
	// clusterOutsideName is a Deployment in clusterOutsideNamespace, outside the workload scope.
	clusterOutsideName      = "outside"
	clusterOutsideNamespace = "k3s-pinning-e2e-outside"
	// clusterBigRef is the large archive's image, added to agent-2's images dir for killMidImport.
	clusterBigRef  = "airgap.example/cluster/big:1.0"
	clusterBigSize = 128 << 20
	// clusterSharedRef is the fleet's image: its archive (OCI, which keeps its digest) is copied
	// onto agent-1 only; with k3s-pinning every node names it by digest in --pinned-images and
	// fetches it from a peer through k3s's embedded registry (--fetch-missing-images).
	clusterSharedRef     = "airgap.example/cluster/shared:1.0"
	clusterSharedSize    = 51 << 20
	clusterSharedArchive = "shared.tar"
	clusterSharedName    = "shared"
)

// The host paths a node's mount namespace mounts its own over: they must exist as mount points.
// Those the test creates are removed afterwards (they stay empty on the host: the mounts are only
// in the nodes' namespaces).
var clusterMountPoints = []string{"/var/lib/rancher/k3s", "/var/lib/kubelet", "/var/log/pods", "/var/log/containers", "/etc/rancher", "/var/lib/cni"}

// nodeScript runs in the node's network namespace and a mount namespace of its own (a slave of the
// host's), and mounts the node's private paths before it execs k3s. Not ip netns exec: it mounts a
// sysfs of the network namespace over /sys, which hides the cgroup hierarchies mounted below it,
// which the kubelet and runc need.
const nodeScript = `set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mount --rbind "$NODE_DIR/data" /var/lib/rancher/k3s
mount --bind "$NODE_DIR/root/kubelet" /var/lib/kubelet
mount --bind "$NODE_DIR/root/pods" /var/log/pods
mount --bind "$NODE_DIR/root/containers" /var/log/containers
mount --bind "$NODE_DIR/root/rancher" /etc/rancher
mount --bind "$NODE_DIR/root/cni" /var/lib/cni
mount --bind "$NODE_DIR/resolv.conf" /etc/resolv.conf
exec "$@"
`

// clusterCNIConf is the nodes' CNI config: k3s's own flannel conflist, at CNI 0.4.0, which the
// plugins of build/cluster-tools.sh speak. containerd reads it from a dir of the node's own (the
// containerd template's conf_dir): k3s writes its own, at 1.0.0, into agent/etc/cni/net.d, and
// its --flannel-cni-conf does not replace it on this tree (k3s master 469d009fb parses the flag
// but never hands it to its flannel setup: seen here, the pods' sandboxes failed with
// "incompatible CNI versions; config is 1.0.0").
const clusterCNIConf = `{
  "name": "cbr0",
  "cniVersion": "0.4.0",
  "plugins": [
    {"type": "flannel", "delegate": {"hairpinMode": true, "forceAddress": true, "isDefaultGateway": true}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

// k3sClusterContainerdTemplate is the single node's template (this VM's settings) with the CNI
// section of k3s's own template, the conf_dir the node's own (clusterCNIConf, at @CNI_CONF_DIR@).
const k3sClusterContainerdTemplate = k3sContainerdTemplate + `
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = [{{ printf "%q" .NodeConfig.AgentConfig.CNIBinDir }}]
  conf_dir = "@CNI_CONF_DIR@"
`

// lan is the test's network: a namespace holding a bridge, and a namespace per node whose eth0 is
// the other end of a veth pair on that bridge. The host's own interfaces and routes are never
// touched: every link is made inside the namespaces.
type lan struct {
	t      *testing.T
	prefix string
	made   []string // namespaces, deleted in reverse order
}

func newLAN(t *testing.T) *lan {
	t.Helper()
	l := &lan{t: t, prefix: fmt.Sprintf("k3sp%d", os.Getpid()%100000)}
	t.Cleanup(l.teardown)
	ns := l.netns("lan")
	l.ip("-n", ns, "link", "add", "br0", "type", "bridge")
	l.ip("-n", ns, "addr", "add", clusterLAN+".1/24", "dev", "br0")
	l.ip("-n", ns, "link", "set", "br0", "up")
	l.ip("-n", ns, "link", "set", "lo", "up")
	return l
}

func (l *lan) ip(args ...string) {
	l.t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		l.t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func (l *lan) netns(name string) string {
	l.t.Helper()
	ns := l.prefix + "-" + name
	l.ip("netns", "add", ns)
	l.made = append(l.made, ns)
	return ns
}

// join makes node's namespace: eth0 at clusterLAN.octet on the bridge, a default route to the
// bridge (the LAN namespace routes nowhere else), forwarding on (pods, flannel's host-gw routes).
func (l *lan) join(node string, octet int) string {
	l.t.Helper()
	ns := l.netns(node)
	veth := fmt.Sprintf("veth%d", octet)
	lanNS := l.prefix + "-lan"
	l.ip("-n", lanNS, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
	l.ip("-n", lanNS, "link", "set", veth, "master", "br0", "up")
	l.ip("-n", ns, "addr", "add", fmt.Sprintf("%s.%d/24", clusterLAN, octet), "dev", "eth0")
	l.ip("-n", ns, "link", "set", "eth0", "up")
	l.ip("-n", ns, "link", "set", "lo", "up")
	l.ip("-n", ns, "route", "add", "default", "via", clusterLAN+".1")
	if out, err := exec.Command("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1").CombinedOutput(); err != nil {
		l.t.Fatalf("sysctl net.ipv4.ip_forward in %s: %v\n%s", ns, err, out)
	}
	// Pods of one node reaching a Service backed by a pod of the same node cross its cni0 bridge:
	// kube-proxy's rules must see bridged traffic (per namespace since Linux 5.3; absent, skipped).
	exec.Command("ip", "netns", "exec", ns, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1").Run()
	return ns
}

// teardown kills whatever still runs in the namespaces, then deletes them (with them, their links).
func (l *lan) teardown() {
	for i := len(l.made) - 1; i >= 0; i-- {
		killNetnsProcs(l.made[i])
		exec.Command("ip", "netns", "del", l.made[i]).Run()
	}
}

// killNetnsProcs SIGKILLs every process in the network namespace ns and waits (10 s at most) for
// them to go.
func killNetnsProcs(ns string) {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		out, _ := exec.Command("ip", "netns", "pids", ns).Output()
		pids := strings.Fields(string(out))
		if len(pids) == 0 {
			return
		}
		for _, p := range pids {
			if pid, err := strconv.Atoi(p); err == nil {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	}
}

// clusterMode is what protects the cluster's nodes.
type clusterMode struct {
	name string
	// daemonSet: stock k3s (--disable-image-pinning) on every node, and k3s-pinning as an operator
	// deploys it there: the image archive in each node's agent/images, deploy/k3s-pinning.yaml
	// (with --pinned-workload-images in "default") in the server's server/manifests.
	daemonSet bool
}

var (
	patchedCluster   = clusterMode{name: "k3s-pinning"}
	daemonSetCluster = clusterMode{name: "stock k3s + DaemonSet", daemonSet: true}
)

// cluster is the server and the agents, server first.
type cluster struct {
	t     *testing.T
	mode  clusterMode
	bin   string // make k3s's bin dir
	tools string // build/cluster-tools.sh's dir
	lan   *lan
	// agentImage is the k3s-pinning image archive (daemonSet mode), copied into each images dir.
	agentImage string
	// shared is clusterSharedRef by digest (repo@sha256:...), as the pinned set names it.
	shared string
	nodes  []*clusterNode
	// kubectlRunner runs kubectl in the server's network namespace, with its kubeconfig.
	kubectlRunner
}

// clusterNode is one node of the cluster: the shared k3sNode in namespaces of its own, its data
// dir /var/lib/rancher/k3s in its mount namespace.
type clusterNode struct {
	*k3sNode
	c        *cluster
	ip       string
	server   bool
	args     []string // k3s's command line, without the binary
	env      []string
	bigImage bool // its images dir also holds clusterBigRef (killMidImport)
}

func (c *cluster) server() *clusterNode { return c.nodes[0] }
func (c *cluster) agents() []*clusterNode {
	return c.nodes[1:]
}

// newCluster makes the LAN and the three nodes' dirs, images and configuration; start runs them.
func newCluster(t *testing.T, mode clusterMode, bin, tools string) *cluster {
	t.Helper()
	requireTools(t)
	for _, tool := range []string{"ip", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: the cluster e2e needs iproute2 and util-linux", tool)
		}
	}
	if out, _ := exec.Command("pgrep", "-f", "k3s (server|agent)").Output(); len(out) > 0 {
		t.Fatalf("a k3s is already running on this machine (%s)", strings.TrimSpace(string(out)))
	}
	created := absentPaths(append([]string{"/var/lib/rancher"}, clusterMountPoints...)...)
	for _, p := range clusterMountPoints {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, p := range slices.Backward(created) {
			os.Remove(p) // empty: the nodes' mounts were in their own namespaces
		}
	})
	c := &cluster{t: t, mode: mode, bin: bin, tools: tools, lan: newLAN(t)}
	if mode.daemonSet {
		c.agentImage = filepath.Join(t.TempDir(), "k3s-pinning-image.tar")
		writeAgentImage(t, c.agentImage)
	}
	c.kubectlRunner = kubectlRunner{kt: t, command: func(args ...string) *exec.Cmd {
		s := c.server()
		return exec.Command("ip", append([]string{"netns", "exec", s.netns, filepath.Join(c.bin, "kubectl"), "--kubeconfig", filepath.Join(s.dir, "kubeconfig")}, args...)...)
	}}
	images := clusterImages(t)
	d, err := images[clusterSharedRef].Digest()
	if err != nil {
		t.Fatal(err)
	}
	c.shared = strings.Split(clusterSharedRef, ":")[0] + "@" + d.String()
	for i, name := range []string{"server", "agent-1", "agent-2"} {
		c.nodes = append(c.nodes, c.newNode(name, 10+i, i == 0, images))
	}
	c.writeManifests()
	if !mode.daemonSet {
		c.agentFlags()
	}
	return c
}

// agentFlags gives the agents k3s-pinning's flags as an operator gives them: agent-1 from its
// config.yaml and a drop-in beside it, agent-2 from its config.yaml and K3S_ variables (k3s reads
// a list's variable as one value: the patterns separated by commas). Every node names the fleet's
// image by digest and fetches what it lacks; agent-1, which holds its archive, also keeps a
// removed archive's images (retained).
func (c *cluster) agentFlags() {
	agent1, agent2 := c.agents()[0], c.agents()[1]
	agent1.writeFile(filepath.Join(agent1.dir, "root", "rancher", "k3s", "config.yaml"),
		fmt.Sprintf("pinned-workload-images: true\npinned-workload-namespaces: [default]\npinned-images: [%q]\nfetch-missing-images: true\nretain-removed-archive-images: true\n", c.shared))
	agent1.writeFile(filepath.Join(agent1.dir, "root", "rancher", "k3s", "config.yaml.d", "50-pinning.yaml"), "pinned-image-labels: [example.com/keep]\n")
	agent2.writeFile(filepath.Join(agent2.dir, "root", "rancher", "k3s", "config.yaml"), "pinned-workload-images: true\npinned-workload-namespaces: [default]\n")
	agent2.env = []string{"K3S_PINNED_IMAGES=registry.example/hand/none:*," + c.shared, "K3S_FETCH_MISSING_IMAGES=true"}
}

// writeManifests puts what the server deploys at its start into its server/manifests, as an
// operator does: the workloads' read access (deploy/k3s-pinning-workloads.yaml), and in daemonSet
// mode the DaemonSet, made as make release makes it (its image for __IMAGE__), with
// --pinned-workload-images (namespace "default") added to its args.
func (c *cluster) writeManifests() {
	c.t.Helper()
	dir := filepath.Join(c.server().data, "server", "manifests")
	read := func(name string) string {
		data, err := os.ReadFile(filepath.Join(repoRoot(c.t), "deploy", name))
		if err != nil {
			c.t.Fatal(err)
		}
		return string(data)
	}
	c.server().writeFile(filepath.Join(dir, "k3s-pinning-workloads.yaml"), read("k3s-pinning-workloads.yaml"))
	if !c.mode.daemonSet {
		return
	}
	ds := strings.ReplaceAll(read("k3s-pinning.yaml"), "__IMAGE__", agentRef)
	const arg = "            - --in-cluster\n"
	if !strings.Contains(ds, arg) {
		c.t.Fatalf("deploy/k3s-pinning.yaml: no %q in the DaemonSet's args", strings.TrimSpace(arg))
	}
	ds = strings.Replace(ds, arg, arg+"            - --pinned-workload-images\n            - --pinned-workload-namespaces=default\n", 1)
	c.server().writeFile(filepath.Join(dir, "k3s-pinning.yaml"), ds)
}

func (c *cluster) newNode(name string, octet int, server bool, images map[string]v1.Image) *clusterNode {
	t := c.t
	t.Helper()
	dir, err := os.MkdirTemp("", "k3s-pinning-cluster-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	data := filepath.Join(dir, "data")
	n := &clusterNode{
		k3sNode: &k3sNode{
			host: &host{t: t, ctx: namespaces.WithNamespace(t.Context(), pinning.DefaultNamespace), dir: dir,
				imagefs: filepath.Join(data, "agent", "containerd"), cgroupRoot: "k3sp-" + name},
			bin: c.bin, name: "k3sp-" + name, pinning: !c.mode.daemonSet, data: data, imagesDir: filepath.Join(data, "agent", "images"),
			path: []string{filepath.Join(c.tools, "cni"), filepath.Join(c.tools, "bin")}, hand: map[string]string{},
		},
		c: c, ip: fmt.Sprintf("%s.%d", clusterLAN, octet), server: server,
	}
	t.Cleanup(n.cleanup)
	n.netns = c.lan.join(name, octet)
	n.makeCgroupRoot()
	for _, d := range []string{"kubelet", "pods", "containers", "rancher/k3s/config.yaml.d", "cni"} {
		if err := os.MkdirAll(filepath.Join(dir, "root", d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.writeFile(filepath.Join(dir, "resolv.conf"), "nameserver "+clusterLAN+".1\n")
	n.writeFile(filepath.Join(dir, "cni", "10-flannel.conflist"), clusterCNIConf)
	n.writeFile(filepath.Join(dir, "registries.yaml"), "mirrors:\n  \"*\":\n    endpoint:\n      - \"http://127.0.0.1:9\"\n")
	n.mountImagefs(k3sImagefsSize)
	n.writeImages(images)
	n.writeFile(filepath.Join(data, "agent", "etc", "containerd", "config-v3.toml.tmpl"), strings.ReplaceAll(k3sClusterContainerdTemplate, "@CNI_CONF_DIR@", filepath.Join(dir, "cni")))
	n.writeFile(filepath.Join(data, "agent", "etc", "kubelet.conf.d", "50-k3s-pinning-e2e.conf"), fmt.Sprintf(k3sKubeletDropIn, evictionThreshold>>20))

	n.args = []string{"--node-name", n.name, "--node-ip", n.ip, "--flannel-iface", "eth0",
		"--resolv-conf", filepath.Join(dir, "resolv.conf"),
		"--kubelet-arg", "cgroup-root=/" + n.cgroupRoot,
		// No pull ever leaves the node: every registry mirrored to a closed loopback port.
		"--private-registry", filepath.Join(dir, "registries.yaml"), "--disable-default-registry-endpoint"}
	if server {
		// --embedded-registry: every node's containerd pulls through k3s's spegel first, which
		// serves what the other nodes' containerd hold (registries.yaml's "*" names what it mirrors).
		n.args = append([]string{"server", "--embedded-registry", "--token", clusterToken, "--cluster-cidr", clusterCIDR, "--service-cidr", serviceCIDR,
			"--cluster-dns", clusterDNS, "--flannel-backend", "host-gw",
			"--write-kubeconfig", filepath.Join(dir, "kubeconfig"), "--write-kubeconfig-mode", "0600",
			"--disable", "traefik,servicelb,metrics-server,coredns,local-storage",
			"--disable-network-policy", "--disable-cloud-controller", "--disable-helm-controller"}, n.args...)
	} else {
		n.args = append([]string{"agent", "--server", fmt.Sprintf("https://%s.10:6443", clusterLAN), "--token", clusterToken,
			"--node-label", clusterRoleLabel + "=agent"}, n.args...)
	}
	if os.Getenv("K3S_E2E_DEBUG") != "" {
		n.args = append(n.args, "--debug") // k3s's and spegel's debug logs, for a failure's hunt
	}
	switch {
	case c.mode.daemonSet:
		n.args = append(n.args, "--disable-image-pinning")
		image, err := os.ReadFile(c.agentImage)
		if err != nil {
			t.Fatal(err)
		}
		n.writeFile(filepath.Join(n.imagesDir, "k3s-pinning-image.tar"), string(image))
	case server:
		n.args = append(n.args, "--pinned-workload-images", "--pinned-workload-namespaces", "default", "--pinned-images", c.shared, "--fetch-missing-images")
	}
	return n
}

// makeCgroupRoot creates the kubelet's --cgroup-root in every cgroup hierarchy (the kubelet
// checks that it exists in each), with the root's cpus and memory nodes for cgroup v1's cpuset,
// whose children need them before any process can join. releaseMounts removes them.
func (n *clusterNode) makeCgroupRoot() {
	n.t.Helper()
	hierarchies, _ := filepath.Glob("/sys/fs/cgroup/*/cgroup.procs")
	if top, _ := filepath.Glob("/sys/fs/cgroup/cgroup.procs"); len(top) > 0 {
		hierarchies = append(hierarchies, top...) // cgroup v2 alone
	}
	for _, procs := range hierarchies {
		dir := filepath.Join(filepath.Dir(procs), n.cgroupRoot)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			n.t.Fatal(err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if data, err := os.ReadFile(filepath.Join(filepath.Dir(procs), f)); err == nil {
				os.WriteFile(filepath.Join(dir, f), data, 0o644)
			}
		}
	}
}

// clusterImages are the cluster's images, made once: every node that has an image has the same one.
// The pause image (k3s's default name) and the web app (netcheck) run; the tool is run by nobody;
// the hand imports are an image nobody wants and a workload's image.
func clusterImages(t *testing.T) map[string]v1.Image {
	t.Helper()
	runs := func(size int64, bin string, entrypoint ...string) v1.Image {
		img, err := imagetest.Image(size, imagetest.Amd64)
		if err != nil {
			t.Fatal(err)
		}
		if bin == "" {
			return img
		}
		if img, err = mutate.AppendLayers(img, binaryLayer(t, bin)); err != nil {
			t.Fatal(err)
		}
		cfg, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		cfg.Config.Entrypoint, cfg.Config.Cmd = entrypoint, nil
		if img, err = mutate.ConfigFile(img, cfg); err != nil {
			t.Fatal(err)
		}
		return img
	}
	sleeper, netcheck := testBinary(t, "sleeper"), testBinary(t, "netcheck")
	return map[string]v1.Image{
		k3sPauseRef:     runs(64<<10, sleeper, "/sleeper"),
		clusterWebRef:   runs(16<<20, netcheck, "/netcheck", "serve", fmt.Sprintf(":%d", clusterWebPort)),
		k3sToolRef:      runs(8<<20, sleeper, "/sleeper"),
		unwantedRef:     runs(32<<20, ""),
		clusterWorkload: runs(32<<20, ""),
		// The fleet's image runs, so that a pod on each node shows it usable there.
		clusterSharedRef: runs(clusterSharedSize, sleeper, "/sleeper"),
	}
}

// writeImages writes the node's images dir: the pause image and the web app in a docker archive
// (as k3s's air-gap tarball), and on the agents also the tool (zstd OCI archive): some nodes hold
// more than others. The hand-import archives (imported later, with ctr): the unwanted image and,
// on the first agent only, the workload's.
func (n *clusterNode) writeImages(images map[string]v1.Image) {
	t := n.t
	if err := os.MkdirAll(n.imagesDir, 0o755); err != nil {
		t.Fatal(err)
	}
	airgap := map[string]v1.Image{k3sPauseRef: images[k3sPauseRef], clusterWebRef: images[clusterWebRef]}
	if err := imagetest.WriteDocker(filepath.Join(n.imagesDir, "airgap-images.tar"), airgap); err != nil {
		t.Fatal(err)
	}
	if !n.server {
		if err := imagetest.WriteOCI(filepath.Join(n.imagesDir, toolArchive), map[string]any{k3sToolRef: images[k3sToolRef]}); err != nil {
			t.Fatal(err)
		}
	}
	hand := []string{unwantedRef}
	if n.name == "k3sp-agent-1" {
		hand = append(hand, clusterWorkload)
		if err := imagetest.WriteOCI(filepath.Join(n.imagesDir, clusterSharedArchive), map[string]any{clusterSharedRef: images[clusterSharedRef]}); err != nil {
			t.Fatal(err)
		}
	}
	for i, ref := range hand {
		path := filepath.Join(n.dir, fmt.Sprintf("hand-%d.tar", i))
		if err := imagetest.WriteDocker(path, map[string]v1.Image{ref: images[ref]}); err != nil {
			t.Fatal(err)
		}
		n.hand[ref] = path
	}
}

// airgapRefs are the references the node's images dir provides.
func (n *clusterNode) airgapRefs() []string {
	refs := []string{k3sPauseRef, clusterWebRef}
	if !n.server {
		refs = append(refs, k3sToolRef)
	}
	if n.c.mode.daemonSet {
		refs = append(refs, agentRef)
	}
	if n.bigImage {
		refs = append(refs, clusterBigRef)
	}
	return refs
}

// launch runs k3s in the node's namespaces with its arguments.
func (n *clusterNode) launch() {
	n.t.Helper()
	n.k3sNode.launch(n.args, n.env...)
}

// start runs k3s in the node's namespaces and waits until its containerd answers, the Node is
// registered, and its images dir is loaded.
func (n *clusterNode) start() {
	n.t.Helper()
	n.launch()
	n.awaitContainerd(3 * time.Minute)
	n.await(3*time.Minute, n.name+": the Node registered", func() bool { return n.c.kubectlOK("get", "node", n.name) })
	n.await(2*time.Minute, n.name+": agent/images loaded", func() bool {
		for _, present := range n.present(n.airgapRefs()...) {
			if !present {
				return false
			}
		}
		return true
	})
}

// cleanup stops everything the node started, whatever state the test left it in: its pods, k3s and
// every process in its network namespace, its kubelet's cgroups, the loop device, its dir.
func (n *clusterNode) cleanup() {
	if n.t.Failed() && n.log != "" {
		n.t.Logf("%s: k3s log (%s), last lines:\n%s", n.name, n.log, lastLines(n.log, 60))
	}
	if n.stopEvents != nil {
		n.stopEvents()
	}
	n.stopPods()
	if n.client != nil {
		n.client.Close()
	}
	if n.cmd != nil {
		containerdtest.Terminate(n.cmd.Process, n.exited, 30*time.Second)
	}
	if n.netns != "" {
		killNetnsProcs(n.netns)
	}
	n.releaseMounts()
	os.RemoveAll(n.dir)
}

func (c *cluster) apply(name, manifest string) {
	c.t.Helper()
	path := filepath.Join(c.server().dir, name+".yaml")
	c.server().writeFile(path, manifest)
	c.mustKubectl("apply", "-f", path)
}

// statusCluster is `k3s-pinning status --cluster` with flags, from the server.
func (c *cluster) statusCluster(flags ...string) (string, int) {
	c.t.Helper()
	return c.server().statusCluster(flags...)
}

// start starts the server, then the agents, and waits until every node is Ready (the CNI is up).
func (c *cluster) start() {
	c.t.Helper()
	for _, n := range c.nodes {
		n.start()
	}
	c.server().await(3*time.Minute, "every node Ready", func() bool {
		out, err := c.kubectl("get", "nodes", "-o", `jsonpath={range .items[*]}{.metadata.name}={.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}`)
		return err == nil && strings.Count(out, "=True") == len(c.nodes)
	})
	c.server().await(2*time.Minute, "the default service account", func() bool { return c.kubectlOK("get", "serviceaccount", "default") })
}

// pods are the pods of app app: node name -> phase (a waiting container's reason, when there is one).
func (c *cluster) pods(app string) map[string][]string { return c.podsOf("default", "app="+app) }

// podsOf are the pods that selector selects in namespace, as pods says.
func (c *cluster) podsOf(namespace, selector string) map[string][]string {
	out, err := c.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
	if err != nil {
		return nil
	}
	var list corev1.PodList
	if json.Unmarshal([]byte(out), &list) != nil {
		return nil
	}
	states := map[string][]string{}
	for _, pod := range list.Items {
		state := string(pod.Status.Phase)
		if pod.Status.Reason != "" {
			state = pod.Status.Reason
		}
		for _, cs := range pod.Status.ContainerStatuses {
			if cs.State.Waiting != nil && cs.State.Waiting.Reason != "" {
				state = cs.State.Waiting.Reason
			}
		}
		states[pod.Spec.NodeName] = append(states[pod.Spec.NodeName], state)
	}
	return states
}

// runningOnEveryAgent says whether app has a Running pod on each agent.
func (c *cluster) runningOnEveryAgent(app string) bool {
	return runningOn(c.pods(app), c.agents())
}

// runningOn says whether pods has a Running pod on each of nodes.
func runningOn(pods map[string][]string, nodes []*clusterNode) bool {
	for _, n := range nodes {
		if !slices.Contains(pods[n.name], "Running") {
			return false
		}
	}
	return true
}

// deployWeb runs the web app on the agents: a Deployment of 2 replicas, one per agent, from the
// images dir only (imagePullPolicy: Never), pod networking (the CNI), behind a Service.
func (c *cluster) deployWeb() {
	c.t.Helper()
	c.apply(clusterWebName, fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: %[1]s, namespace: default}
spec:
  replicas: 2
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
      terminationGracePeriodSeconds: 1
      nodeSelector: {%[3]s: agent}
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule, labelSelector: {matchLabels: {app: %[1]s}}}
      containers:
      - name: web
        image: %[2]s
        imagePullPolicy: Never
        env: [{name: NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}]
        ports: [{containerPort: %[4]d}]
---
apiVersion: v1
kind: Service
metadata: {name: %[1]s, namespace: default}
spec:
  selector: {app: %[1]s}
  ports: [{port: 80, targetPort: %[4]d}]
`, clusterWebName, clusterWebRef, clusterRoleLabel, clusterWebPort))
	c.server().await(3*time.Minute, "the web app Running on both agents", func() bool { return c.runningOnEveryAgent(clusterWebName) })
}

// crossNodeRequest runs a pod on from that asks the web Service until the pod on to answers, and
// returns how the pod ended (Succeeded: the request crossed from one agent to the other).
func (c *cluster) crossNodeRequest(from, to *clusterNode) string {
	c.t.Helper()
	ip := strings.TrimSpace(c.mustKubectl("get", "service", clusterWebName, "-o", "jsonpath={.spec.clusterIP}"))
	name := "client-" + strings.TrimPrefix(from.name, "k3sp-")
	c.apply(name, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %[1]s, namespace: default, labels: {app: %[1]s}}
spec:
  nodeName: %[2]s
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - {name: get, image: %[3]s, imagePullPolicy: Never, command: [/netcheck, get, "http://%[4]s/", %[5]s]}
`, name, from.name, clusterWebRef, ip, to.name))
	var phase string
	c.server().await(2*time.Minute, name+" done", func() bool {
		out, _ := c.kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}")
		phase = strings.TrimSpace(out)
		return phase == "Succeeded" || phase == "Failed"
	})
	logs, _ := c.kubectl("logs", name)
	c.t.Logf("%s on %s, asking %s (Service %s) for %s's pod: %s\n%s", name, from.name, clusterWebName, ip, to.name, phase, tail(logs, 3))
	return phase
}

// parkWorkload runs a Deployment scaled to 0 whose image was imported by hand on the first agent
// only; with --pinned-workload-images (and deploy/k3s-pinning-workloads.yaml, in the server's
// manifests) that agent keeps it pinned. Another Deployment scaled to 0, in a namespace outside
// --pinned-workload-namespaces, names the hand import nobody wants: it is applied first, and
// must not make any node keep it.
func (c *cluster) parkWorkload() {
	c.t.Helper()
	deployment := func(name, namespace, image string) string {
		return fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: %[1]s, namespace: %[2]s}
spec:
  replicas: 0
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
      containers:
      - {name: main, image: %[3]s, imagePullPolicy: Never}
`, name, namespace, image)
	}
	c.apply(clusterOutsideName, fmt.Sprintf("apiVersion: v1\nkind: Namespace\nmetadata: {name: %s}\n---\n", clusterOutsideNamespace)+
		deployment(clusterOutsideName, clusterOutsideNamespace, unwantedRef))
	c.apply(clusterParkedName, deployment(clusterParkedName, "default", clusterWorkload))
}

// nodeReadsInScopeOnly checks, on the API server, what the credentials --pinned-workload-images
// uses may read (issue "Trust", item 3): agent-1's kubelet credentials (what a patched k3s reads
// the workloads with) and, with the DaemonSet, its service account list pods and Deployments in
// "default", the namespace in scope, and are refused a cluster-wide list of either.
func (c *cluster) nodeReadsInScopeOnly(r *clusterReport) {
	c.t.Helper()
	agent1 := c.agents()[0]
	asKubelet := func(args ...string) (string, error) {
		return agent1.tool("kubectl", append([]string{"--kubeconfig", "/var/lib/rancher/k3s/agent/kubelet.kubeconfig"}, args...)...)
	}
	type reader struct {
		who string
		get func(args ...string) (string, error)
	}
	readers := []reader{{agent1.name + "'s kubelet credentials", asKubelet}}
	if c.mode.daemonSet {
		readers = append(readers, reader{"the DaemonSet's service account", func(args ...string) (string, error) {
			return c.kubectl(append([]string{"--as", "system:serviceaccount:k3s-pinning:k3s-pinning"}, args...)...)
		}})
	}
	for _, rd := range readers {
		for _, tc := range []struct {
			what    string
			args    []string
			allowed bool
		}{
			{"list pods in default (in scope)", []string{"get", "pods", "-n", "default", "-o", "name"}, true},
			{"list deployments in default (in scope)", []string{"get", "deployments", "-n", "default", "-o", "name"}, true},
			{"list pods cluster-wide", []string{"get", "pods", "--all-namespaces", "-o", "name"}, false},
			{"list deployments cluster-wide", []string{"get", "deployments", "--all-namespaces", "-o", "name"}, false},
			{"list pods in " + clusterOutsideNamespace + " (outside the scope)", []string{"get", "pods", "-n", clusterOutsideNamespace, "-o", "name"}, false},
		} {
			out, err := rd.get(tc.args...)
			got := "allowed"
			if err != nil {
				got = "denied"
				if !strings.Contains(out, "Forbidden") && !strings.Contains(out, "forbidden") {
					got = "failed: " + strings.TrimSpace(tail(out, 1))
				}
			}
			c.t.Logf("%s: %s: %s", rd.who, tc.what, got)
			if want := map[bool]string{true: "allowed", false: "denied"}[tc.allowed]; got != want {
				c.t.Errorf("%s: %s: %s, want %s\n%s", rd.who, tc.what, got, want, strings.TrimSpace(out))
			}
			r.set(rd.who+": "+tc.what, "", got)
		}
	}
}

// clusterReport is what one cluster showed: a cell per scenario and node ("" node: the cluster).
type clusterReport struct {
	mode  string
	cells map[[2]string]string
	order [][2]string
}

func (r *clusterReport) set(scenario, node, cell string) {
	key := [2]string{scenario, strings.TrimPrefix(node, "k3sp-")}
	if r.cells == nil {
		r.cells = map[[2]string]string{}
	}
	if _, ok := r.cells[key]; !ok {
		r.order = append(r.order, key)
	}
	r.cells[key] = cell
}

// printClusterTable prints the reports side by side, a row per scenario and node.
func printClusterTable(reports ...*clusterReport) {
	// One order for all: a row only one report has goes after that report's row before it.
	var order [][2]string
	for _, r := range reports {
		at := 0
		for _, key := range r.order {
			if i := slices.Index(order, key); i >= 0 {
				at = i + 1
				continue
			}
			order = slices.Insert(order, at, key)
			at++
		}
	}
	fmt.Println("\n==== make cluster-e2e: a server and two agents, each scenario on each node")
	header := "| scenario | node |"
	rule := "|---|---|"
	for _, r := range reports {
		header += " " + r.mode + " |"
		rule += "---|"
	}
	fmt.Println(header)
	fmt.Println(rule)
	for _, key := range order {
		line := "| " + key[0] + " | " + key[1] + " |"
		for _, r := range reports {
			cell, ok := r.cells[key]
			if !ok {
				cell = "-"
			}
			line += " " + cell + " |"
		}
		fmt.Println(line)
	}
}

// keptCell says which of refs are present and pinned: "all N present, pinned", or what is not.
func keptCell(n *clusterNode, refs []string) string {
	var lost, unpinned []string
	present := n.present(refs...)
	for _, ref := range refs {
		switch {
		case !present[ref]:
			lost = append(lost, "LOST "+ref)
		case !n.criPinned(ref):
			unpinned = append(unpinned, "unpinned "+ref)
		}
	}
	if len(lost)+len(unpinned) == 0 {
		return fmt.Sprintf("all %d present, pinned", len(refs))
	}
	return strings.Join(append(lost, unpinned...), ", ")
}

// clusterView is each node's AirgapImagesProtected as `k3s-pinning status --cluster -o json`
// shows it ("True", or "False ImagesMissing", ...) and the command's exit code.
func (c *cluster) clusterView() (map[string]string, int) {
	c.t.Helper()
	out, code := c.statusCluster("-o", "json")
	var status struct {
		Nodes []struct{ Node, Status, Reason string }
	}
	view := map[string]string{}
	// The JSON first; stderr follows it when a node is not protected (exit 1).
	if json.NewDecoder(strings.NewReader(out)).Decode(&status) == nil {
		for _, n := range status.Nodes {
			view[n.Node] = strings.TrimSuffix(n.Status+" "+n.Reason, " AllImagesPresentAndPinned")
		}
	}
	return view, code
}

// awaitProtected waits until status --cluster says every node is protected, and puts each node's
// view in the report under scenario.
func (c *cluster) awaitProtected(r *clusterReport, scenario string) {
	c.t.Helper()
	var view map[string]string
	defer func() {
		if c.t.Failed() {
			out, code := c.statusCluster()
			c.t.Logf("status --cluster (exit %d) when the wait ended:\n%s", code, out)
		}
	}()
	c.server().await(3*time.Minute, "status --cluster: every node protected ("+scenario+")", func() bool {
		var code int
		view, code = c.clusterView()
		return code == 0 && len(view) == len(c.nodes)
	})
	for _, n := range c.nodes {
		r.set(scenario+": status --cluster", n.name, view[n.name])
	}
}

// memoryCell is the k3s process's VmRSS and VmHWM.
func (n *clusterNode) memoryCell() string {
	m, err := containerdtest.ProcessMemory(n.cmd.Process.Pid)
	if err != nil {
		return "?"
	}
	return fmt.Sprintf("%.0f MiB (peak %.0f MiB)", m.RSS, m.HWM)
}

// TestCluster: a server and two agents, first with k3s-pinning in k3s (its flags given each way a
// k3s operator gives them), then as stock k3s protected by the DaemonSet; the same scenarios on
// both, one table.
func TestCluster(t *testing.T) {
	bin := k3sBinDir(t)
	tools := os.Getenv("K3S_CLUSTER_TOOLS")
	if tools == "" {
		t.Skip("*** SKIPPED: K3S_CLUSTER_TOOLS is not set: make cluster-e2e builds the nodes' iptables and CNI plugins (build/cluster-tools.sh) and sets it ***")
	}
	var reports []*clusterReport
	defer func() { printClusterTable(reports...) }()
	for _, mode := range []clusterMode{patchedCluster, daemonSetCluster} {
		r := &clusterReport{mode: mode.name}
		reports = append(reports, r)
		t.Run(strings.ReplaceAll(mode.name, " ", ""), func(t *testing.T) { runCluster(t, mode, bin, tools, r) })
	}
}

func runCluster(t *testing.T, mode clusterMode, bin, tools string, r *clusterReport) {
	c := newCluster(t, mode, bin, tools)
	agent1, agent2 := c.agents()[0], c.agents()[1]
	start := time.Now()
	c.start()
	ready := time.Now()
	t.Logf("cluster of %d nodes Ready in %s", len(c.nodes), ready.Sub(start).Round(time.Second))
	if mode.daemonSet {
		ds := c.server().await(3*time.Minute, "the DaemonSet's pod Running on every node", func() bool {
			return runningOn(c.podsOf("k3s-pinning", "app.kubernetes.io/name=k3s-pinning"), c.nodes)
		})
		r.set("DaemonSet from server/manifests", "", fmt.Sprintf("a pod Running on each node %s after every node was Ready", ds.Round(time.Second)))
	}
	for _, n := range c.nodes {
		n.await(2*time.Minute, n.name+": every air-gap image pinned", func() bool {
			return !slices.Contains(slices.Collect(maps.Values(n.pins(n.airgapRefs()...))), false)
		})
		r.set("started: air-gap images", n.name, keptCell(n, n.airgapRefs()))
		// From here on, an air-gap image that containerd's events show without its pin fails the test.
		n.watchPins(n.socket, n.airgapRefs())
	}
	c.awaitProtected(r, "started")
	out, code := c.statusCluster()
	t.Logf("k3s-pinning status --cluster (exit %d):\n%s", code, out)
	if mode.daemonSet {
		c.ownNodeOnly(r)
	}
	c.fleet(r, ready)

	c.deployWeb()
	phase := c.crossNodeRequest(agent2, agent1)
	if phase != "Succeeded" {
		t.Errorf("a pod on %s did not reach the pod on %s through the Service: %s", agent2.name, agent1.name, phase)
	}
	r.set("web app: 2 replicas, imagePullPolicy Never; agent-2 -> Service -> agent-1", "", "Running on both agents; request "+phase)

	for _, n := range c.agents() {
		n.handImport()
	}
	c.parkWorkload()
	parked := agent1.await(2*time.Minute, clusterWorkload+" pinned on "+agent1.name+" for the Deployment scaled to 0", func() bool { return agent1.criPinned(clusterWorkload) })
	r.set("workload scaled to 0, its image imported by hand on agent-1 only", agent1.name, fmt.Sprintf("pinned %s after the Deployment", parked.Round(100*time.Millisecond)))
	// The Deployment outside the scope was applied first: by the time the one in scope is
	// pinned, a watcher that read every namespace would have pinned its image as well.
	for _, n := range c.agents() {
		if n.criPinned(unwantedRef) {
			t.Errorf("%s: %s pinned for a Deployment in %s, outside --pinned-workload-namespaces", n.name, unwantedRef, clusterOutsideNamespace)
		}
	}
	r.set("a workload outside the namespaces in scope names the unwanted hand import", "", yesNo(!agent1.criPinned(unwantedRef) && !agent2.criPinned(unwantedRef), "not pinned on any agent", "PINNED"))
	c.nodeReadsInScopeOnly(r)

	// Real disk pressure on agent-1: its kubelet reclaims (the unwanted hand import goes) and
	// evicts; every air-gap image of that node and the workload's image stay; the web pod comes
	// back Running; agent-2 and the server are untouched.
	before := map[string]map[string]bool{}
	for _, n := range c.nodes {
		before[n.name] = n.present(n.airgapRefs()...)
	}
	// The workload's image has one copy in the cluster: the kubelets' node.status.images list it
	// on agent-1 only (once agent-1's kubelet has reported it: it lists images every status
	// update, 10 s apart at most while they change).
	var only string
	agent1.await(2*time.Minute, "node.status.images listing "+clusterWorkload, func() bool {
		only = strings.Join(c.holders(clusterWorkload), ", ")
		return only != ""
	})
	if only != strings.TrimPrefix(agent1.name, "k3sp-") {
		t.Errorf("node.status.images list %s on [%s], want agent-1 only", clusterWorkload, only)
	}
	release := agent1.fill(evictionThreshold - 100<<20)
	reclaim := agent1.await(3*time.Minute, agent1.name+": the kubelet reclaiming the unwanted image under disk pressure", func() bool { return !agent1.present(unwantedRef)[unwantedRef] })
	time.Sleep(15 * time.Second) // the reclaim after an eviction (an evicted pod's image is unused then)
	after := agent1.present(append(agent1.airgapRefs(), clusterWorkload)...)
	r.set("disk pressure on agent-1 (dd): the kubelet reclaims", agent1.name, fmt.Sprintf("unwanted hand import reclaimed in %s; air-gap + workload (its only copy: node.status.images list it on [%s]): %s",
		reclaim.Round(100*time.Millisecond), only, keptCell(agent1, append(agent1.airgapRefs(), clusterWorkload))))
	if err := os.Remove(release); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: pressure reclaimed in %s; present after: %v", agent1.name, reclaim.Round(100*time.Millisecond), after)
	for ref, ok := range after {
		if !ok {
			t.Errorf("%s: %s DELETED by the kubelet under disk pressure", agent1.name, ref)
		}
	}
	c.server().await(3*time.Minute, "the web app Running on both agents after the pressure", func() bool { return c.runningOnEveryAgent(clusterWebName) })
	for _, n := range []*clusterNode{c.server(), agent2} {
		got := n.present(n.airgapRefs()...)
		if !maps.Equal(got, before[n.name]) {
			t.Errorf("%s: images changed while %s was under pressure: %v, before %v", n.name, agent1.name, got, before[n.name])
		}
		cell := "untouched: " + keptCell(n, n.airgapRefs())
		if !n.server && !n.present(unwantedRef)[unwantedRef] {
			t.Errorf("%s: its unwanted hand import is gone, but the pressure was on %s", n.name, agent1.name)
			cell = "unwanted hand import GONE"
		}
		r.set("disk pressure on agent-1 (dd): the kubelet reclaims", n.name, cell)
	}
	c.awaitProtected(r, "after the pressure")

	// The server stopped for 60 s: the agents keep protecting locally (a crictl rmi of an air-gap
	// image on agent-1 is restored meanwhile), and once the API server is back its Event and the
	// condition reach the cluster, with no agent restarted.
	c.server().stop()
	downSince := time.Now()
	if out, err := agent1.crictl("rmi", k3sToolRef); err != nil {
		t.Fatalf("%s: crictl rmi %s: %v\n%s", agent1.name, k3sToolRef, err, out)
	}
	restored := agent1.await(30*time.Second, k3sToolRef+" restored on "+agent1.name+" while the server is down", func() bool {
		return agent1.present(k3sToolRef)[k3sToolRef] && agent1.criPinned(k3sToolRef)
	})
	t.Logf("server down: %s restored and pinned on %s in %s", k3sToolRef, agent1.name, restored.Round(100*time.Millisecond))
	time.Sleep(60*time.Second - time.Since(downSince))
	c.server().start()
	back := c.server().await(3*time.Minute, "the ImageRestored Event of "+agent1.name+" in the cluster", func() bool {
		out, err := c.kubectl("get", "events", "-A", "--field-selector", "involvedObject.kind=Node,involvedObject.name="+agent1.name+",reason=ImageRestored",
			"-o", "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}")
		return err == nil && strings.Contains(out, k3sToolRef)
	})
	r.set("server stopped 60 s; crictl rmi of an air-gap image on agent-1 meanwhile", agent1.name,
		fmt.Sprintf("restored, pinned in %s; its ImageRestored Event in the cluster %s after the server's start", restored.Round(100*time.Millisecond), back.Round(time.Second)))
	c.awaitProtected(r, "after the server's return")
	for _, a := range c.agents() {
		if a.starts != 1 {
			t.Errorf("%s was started %d times", a.name, a.starts)
		}
	}
	c.killMidImport(r)

	c.restoreOnFullDisk(r)

	for _, n := range c.nodes {
		n.stopEvents()
		n.stopEvents = nil
		seen := "none"
		if len(n.seenUnpinned) > 0 {
			var refs []string
			for _, what := range n.seenUnpinned {
				if ref, _, _ := strings.Cut(what, " ("); !slices.Contains(refs, ref) {
					refs = append(refs, ref)
				}
			}
			seen = fmt.Sprintf("%d image(s) in %d event(s) or listings: %s", len(refs), len(n.seenUnpinned), strings.Join(refs, ", "))
			if mode.daemonSet {
				// Stock k3s clears its pins when it starts (then labels its images again); the
				// DaemonSet's pod cannot stop that, only pin them again, which keptCell checks.
				seen += "; by stock k3s's (re)start; now " + keptCell(n, n.airgapRefs())
			} else {
				t.Errorf("%s: containerd's events showed air-gap images unpinned: %v", n.name, n.seenUnpinned)
			}
		}
		r.set("air-gap images seen unpinned (containerd's events, after the start)", n.name, seen)
	}
	for _, n := range c.nodes {
		r.set("k3s resident memory at the end", n.name, n.memoryCell())
	}
}

// ownNodeOnly checks the DaemonSet's ValidatingAdmissionPolicy from outside, with the service
// account's tokens: one bound to the DaemonSet's pod on agent-2 writes agent-2's condition, and
// is refused agent-1's condition, every other part of agent-2 a status write can change (labels,
// owner references, finalizers, daemon endpoints, images), an Event about agent-1, and agent-1's
// Event re-pointed to agent-2; a token bound to no pod writes nothing.
func (c *cluster) ownNodeOnly(r *clusterReport) {
	c.t.Helper()
	agent1, agent2 := c.agents()[0], c.agents()[1]
	pod := strings.TrimSpace(c.mustKubectl("get", "pods", "-n", "k3s-pinning", "--field-selector", "spec.nodeName="+agent2.name, "-o", "jsonpath={.items[0].metadata.name}"))
	bound := strings.TrimSpace(c.mustKubectl("create", "token", "k3s-pinning", "-n", "k3s-pinning", "--bound-object-kind", "Pod", "--bound-object-name", pod))
	unbound := strings.TrimSpace(c.mustKubectl("create", "token", "k3s-pinning", "-n", "k3s-pinning"))
	as := func(token string, args ...string) (string, error) {
		kubeconfig := filepath.Join(c.server().dir, "token-kubeconfig")
		c.server().writeFile(kubeconfig, fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://%s.10:6443", certificate-authority: %q}}]
users: [{name: u, user: {token: %q}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`, clusterLAN, filepath.Join(c.server().data, "server", "tls", "server-ca.crt"), token))
		cmd := exec.Command("ip", append([]string{"netns", "exec", c.server().netns, filepath.Join(c.bin, "kubectl"), "--kubeconfig", kubeconfig}, args...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	// patch sends one PATCH as the account's Event recorder does, with no GET first (kubectl
	// patch reads the object, which the account may not).
	patch := func(token, path, body string) (string, error) {
		cmd := exec.Command("ip", "netns", "exec", c.server().netns, "curl", "-sS", "--fail-with-body",
			"--cacert", filepath.Join(c.server().data, "server", "tls", "server-ca.crt"), "-H", "Authorization: Bearer "+token,
			"-H", "Content-Type: application/merge-patch+json", "-X", "PATCH", "--data", body,
			fmt.Sprintf("https://%s.10:6443%s", clusterLAN, path))
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	condition := func(node string) []string {
		return []string{"patch", "node", node, "--subresource", "status", "--type", "strategic", "-p",
			fmt.Sprintf(`{"status":{"conditions":[{"type":"AirgapImagesProtected","status":"True","reason":"AllImagesPresentAndPinned","message":"written by ownNodeOnly","lastHeartbeatTime":%q,"lastTransitionTime":%q}]}}`,
				time.Now().UTC().Format(time.RFC3339), time.Now().UTC().Format(time.RFC3339))}
	}
	event := filepath.Join(c.server().dir, "event.yaml")
	c.server().writeFile(event, fmt.Sprintf(`apiVersion: v1
kind: Event
metadata: {generateName: k3s-pinning-e2e-, namespace: default}
involvedObject: {kind: Node, name: %s, uid: %s}
reason: ImageRestored
message: written by ownNodeOnly
type: Normal
source: {component: k3s-pinning}
`, agent1.name, agent1.name))
	status := func(patch string) []string {
		return []string{"patch", "node", agent2.name, "--subresource", "status", "--type", "merge", "-p", patch}
	}
	// An Event about agent-1 (its kubelet's, or its agent's), for agent-2's token to re-point.
	agent1Event := strings.TrimSpace(c.mustKubectl("get", "events", "-n", "default", "--field-selector", "involvedObject.kind=Node,involvedObject.name="+agent1.name, "-o", "jsonpath={.items[0].metadata.name}"))
	if agent1Event == "" {
		c.t.Fatalf("no Event about %s in the default namespace", agent1.name)
	}
	for _, tc := range []struct {
		what    string
		token   string
		args    []string // kubectl's, or PATCH, the API path and the body
		allowed bool
	}{
		{"its own node's condition", bound, condition(agent2.name), true},
		{"another node's condition", bound, condition(agent1.name), false},
		{"its own node's labels, through the status", bound, status(`{"metadata":{"labels":{"k3s-pinning.e2e/owned":"yes"}}}`), false},
		{"its own node's owner references, through the status", bound, status(fmt.Sprintf(`{"metadata":{"ownerReferences":[{"apiVersion":"v1","kind":"Node","name":%q,"uid":"k3s-pinning-e2e"}]}}`, agent1.name)), false},
		{"its own node's finalizers, through the status", bound, status(`{"metadata":{"finalizers":["k3s-pinning.e2e/held"]}}`), false},
		{"its own node's daemon endpoints", bound, status(`{"status":{"daemonEndpoints":{"kubeletEndpoint":{"Port":1}}}}`), false},
		{"its own node's images", bound, status(`{"status":{"images":[{"names":["k3s-pinning.e2e/fake:1"],"sizeBytes":1}]}}`), false},
		{"an Event about another node", bound, []string{"create", "-f", event}, false},
		{"another node's Event, re-pointed to its own", bound, []string{"PATCH", "/api/v1/namespaces/default/events/" + agent1Event,
			fmt.Sprintf(`{"involvedObject":{"name":%q,"uid":%q}}`, agent2.name, agent2.name)}, false},
		{"its own node's condition, with a token bound to no pod", unbound, condition(agent2.name), false},
	} {
		var out string
		var err error
		if tc.args[0] == "PATCH" {
			out, err = patch(tc.token, tc.args[1], tc.args[2])
		} else {
			out, err = as(tc.token, tc.args...)
		}
		got := "allowed"
		if err != nil {
			got = "denied"
			if !strings.Contains(out, "ValidatingAdmissionPolicy 'k3s-pinning-own-node'") {
				got = "denied (not by the policy: " + strings.TrimSpace(tail(out, 1)) + ")"
			}
		}
		c.t.Logf("the DaemonSet's service account (pod on %s): %s: %s\n%s", agent2.name, tc.what, got, strings.TrimSpace(out))
		if (err == nil) != tc.allowed || strings.Contains(got, "not by the policy") {
			c.t.Errorf("the DaemonSet's service account: %s: %s, want %s", tc.what, got, map[bool]string{true: "allowed", false: "denied by the policy"}[tc.allowed])
		}
		r.set("the DaemonSet's token writes: "+tc.what, "", got)
	}
}

// stop stops the node's k3s (SIGTERM, as systemd does) and waits for it; its pods keep running.
func (n *clusterNode) stop() {
	n.t.Helper()
	n.k3sNode.stop()
	n.killPods()
}

// killPods kills what the node's pods run (every process under its kubelet's kubepods cgroup)
// once its k3s is stopped. A node's /run is a fresh tmpfs at each start, so the next containerd
// does not know the containers the last one ran, and the kubelet starts them again beside the
// orphans: two DaemonSet pods reporting on one Node, the orphan's socket dead (seen: its periodic
// reconcile wrote the node's condition False). On a real node /run outlives k3s and containerd
// takes its containers back.
func (n *clusterNode) killPods() {
	var dirs []string
	for _, pattern := range []string{"/sys/fs/cgroup/*/" + n.cgroupRoot + "/kubepods", "/sys/fs/cgroup/" + n.cgroupRoot + "/kubepods"} {
		found, _ := filepath.Glob(pattern)
		dirs = append(dirs, found...)
	}
	killCgroupProcs(dirs)
}

// hog keeps the node's imagefs full, as a pod writing to it would: it appends to a file there
// whenever a byte is free. The returned func stops it and removes the file.
func (n *clusterNode) hog() (stop func()) {
	path := filepath.Join(n.imagefs, "hog.bin")
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		n.t.Fatal(err)
	}
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		buf := make([]byte, 4<<10)
		for {
			select {
			case <-done:
				return
			default:
			}
			if _, err := f.Write(buf); err != nil {
				time.Sleep(time.Millisecond)
			}
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			close(done)
			<-stopped
			f.Close()
			os.Remove(path)
		})
	}
	n.t.Cleanup(stop) // before the node's cleanup unmounts the imagefs, also after a failure
	return stop
}

// restoresFailed is the agent's count of failed restores, from its state file (the patched k3s
// and the DaemonSet keep it at the same place, agent/k3s-pinning/state.json).
func (n *clusterNode) restoresFailed() int {
	data, err := os.ReadFile(filepath.Join(n.data, "agent", "k3s-pinning", "state.json"))
	if err != nil {
		n.t.Fatal(err)
	}
	var state struct {
		Agent struct{ RestoresFailed int }
	}
	if err := json.Unmarshal(data, &state); err != nil {
		n.t.Fatalf("%s: state file: %v", n.name, err)
	}
	return state.Agent.RestoresFailed
}

// restoreOnFullDisk: agent-1's imagefs filled to the last MiB, then an air-gap image crictl
// rmi'd: its restore fails (ENOSPC) with an ImageRestoreFailed Event and the condition False, no
// image record is left half made, the retries back off (counted over 40 s), and once the space
// is freed the image comes back pinned with no restart.
func (c *cluster) restoreOnFullDisk(r *clusterReport) {
	c.t.Helper()
	agent1 := c.agents()[0]
	const scenario = "imagefs full (ENOSPC) on agent-1, then crictl rmi of an air-gap image"
	// A pod writing to the full disk takes whatever the rmi frees before the restore can: without
	// it, the rmi frees exactly what the restore needs.
	full := agent1.fill(0)
	hog := agent1.hog()
	if out, err := agent1.crictl("rmi", k3sToolRef); err != nil {
		c.t.Fatalf("%s: crictl rmi %s: %v\n%s", agent1.name, k3sToolRef, err, out)
	}
	var event string
	failed := c.server().await(2*time.Minute, "the ImageRestoreFailed Event of "+agent1.name, func() bool {
		out, err := c.kubectl("get", "events", "-A", "--field-selector", "involvedObject.kind=Node,involvedObject.name="+agent1.name+",reason=ImageRestoreFailed",
			"-o", "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}")
		event = strings.TrimSpace(out)
		return err == nil && strings.Contains(out, k3sToolRef)
	})
	var view map[string]string
	c.server().await(time.Minute, "status --cluster: "+agent1.name+" not protected", func() bool {
		view, _ = c.clusterView()
		return strings.HasPrefix(view[agent1.name], "False")
	})
	first := agent1.restoresFailed()
	time.Sleep(40 * time.Second)
	retries := agent1.restoresFailed() - first
	halfMade := agent1.present(k3sToolRef)[k3sToolRef]
	c.t.Logf("%s: full imagefs: ImageRestoreFailed in the cluster %s after the rmi (%s); status --cluster %s; %d failed restores in 40 s",
		agent1.name, failed.Round(100*time.Millisecond), tail(event, 1), view[agent1.name], retries)
	if halfMade {
		c.t.Errorf("%s: %s has an image record while its restore fails on a full disk", agent1.name, k3sToolRef)
	}
	if retries > 10 {
		c.t.Errorf("%s: %d failed restores in 40 s on a full disk: a busy loop", agent1.name, retries)
	}
	hog()
	if err := os.Remove(full); err != nil {
		c.t.Fatal(err)
	}
	back := agent1.await(3*time.Minute, k3sToolRef+" restored and pinned once the space is freed", func() bool {
		return agent1.present(k3sToolRef)[k3sToolRef] && agent1.criPinned(k3sToolRef)
	})
	r.set(scenario, agent1.name, fmt.Sprintf("ImageRestoreFailed %s after the rmi, condition %s, image record: %s, %d retries in 40 s; back, pinned %s after the space was freed",
		failed.Round(100*time.Millisecond), view[agent1.name], map[bool]string{true: "PRESENT", false: "none"}[halfMade], retries, back.Round(100*time.Millisecond)))
	c.awaitProtected(r, "after the full disk")
}

// killMidImport: agent-2's k3s stopped, a large archive added to its images dir, k3s started and
// SIGKILLed while that archive's content is being written (containerd's ingest dir not empty;
// k3s's containerd dies with it), then started again: every image of its images dir present,
// whole and pinned, and no import lease of k3s-pinning left behind (one would hold the killed
// import's content for 24 hours). Leases of k3s's own import are counted, not failed on.
func (c *cluster) killMidImport(r *clusterReport) {
	c.t.Helper()
	agent2 := c.agents()[1]
	const scenario = "kill -9 of k3s mid-import (a 128 MiB archive added), then started again"
	agent2.stop()
	img, err := imagetest.Image(clusterBigSize, imagetest.Amd64)
	if err != nil {
		c.t.Fatal(err)
	}
	if err := imagetest.WriteDocker(filepath.Join(agent2.imagesDir, "big.tar"), map[string]v1.Image{clusterBigRef: img}); err != nil {
		c.t.Fatal(err)
	}
	agent2.bigImage = true
	agent2.stopEvents()
	agent2.watchPins(agent2.socket, agent2.airgapRefs())
	ingest := filepath.Join(agent2.data, "agent", "containerd", "io.containerd.content.v1.content", "ingest")
	agent2.launch()
	var killedAt time.Duration
	for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
		if entries, _ := os.ReadDir(ingest); len(entries) > 0 {
			killedAt = time.Since(start)
			syscall.Kill(agent2.cmd.Process.Pid, syscall.SIGKILL)
			break
		}
		if time.Since(start) > 2*time.Minute {
			c.t.Fatalf("%s: the import of %s was not seen under way (containerd's ingest dir stayed empty)", agent2.name, clusterBigRef)
		}
	}
	<-agent2.exited
	agent2.killPods()
	agent2.client = nil
	c.t.Logf("%s: k3s SIGKILLed %s after its start, the import of %s under way", agent2.name, killedAt.Round(10*time.Millisecond), clusterBigRef)
	agent2.start()
	agent2.await(2*time.Minute, agent2.name+": every air-gap image pinned after the restart", func() bool {
		return !slices.Contains(slices.Collect(maps.Values(agent2.pins(agent2.airgapRefs()...))), false)
	})
	whole := "whole"
	if got, err := agent2.client.GetImage(agent2.ctx, clusterBigRef); err != nil {
		c.t.Fatalf("%s: %s: %v", agent2.name, clusterBigRef, err)
	} else if ok, _, _, missing, err := images.Check(agent2.ctx, agent2.client.ContentStore(), got.Target(), platforms.Default()); err != nil || !ok {
		whole = fmt.Sprintf("NOT WHOLE (%d blobs missing, %v)", len(missing), err)
		c.t.Errorf("%s: %s after the restart: %s", agent2.name, clusterBigRef, whole)
	}
	// The killed import's lease is deleted by the restarted agent's first sync; the lease of its
	// own import of big outlives the pinned reference (the lease of a sync's imports goes when
	// the sync ends, after every archive's last name), so the leases are asked for until ours are
	// gone, 30 s at most: one there then is left behind. (A single list right after the pins saw
	// that import's lease once, in make test.)
	var ours int
	var others []string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		all, err := agent2.client.LeasesService().List(agent2.ctx)
		if err != nil {
			c.t.Fatal(err)
		}
		ours, others = 0, nil
		for _, l := range all {
			if _, ok := l.Labels[agentimages.LabelImportLease]; ok {
				ours++
			} else {
				others = append(others, fmt.Sprintf("%s (created %s)", l.ID, l.CreatedAt.Format(time.TimeOnly)))
			}
		}
		if ours == 0 || time.Now().After(deadline) {
			break
		}
	}
	c.t.Logf("%s: leases after the restart: %d of k3s-pinning; others: %v", agent2.name, ours, others)
	if ours > 0 {
		c.t.Errorf("%s: %d import lease(s) of k3s-pinning left 30 s after every reference was pinned again", agent2.name, ours)
	}
	r.set(scenario, agent2.name, fmt.Sprintf("killed %s after the start, import under way; after the restart: %s, %s %s; leases: %d of k3s-pinning, %d others",
		killedAt.Round(10*time.Millisecond), keptCell(agent2, agent2.airgapRefs()), clusterBigRef, whole, ours, len(others)))
	c.awaitProtected(r, "after the kill -9")
}

// fleet: the fleet's image, whose archive only agent-1 holds, through k3s's embedded registry.
// With k3s-pinning every node names it by digest: the peers fetch it from agent-1 and pin it, a
// pod runs it on each node with imagePullPolicy Never, and once agent-1's archive is deleted and
// the image removed there (crictl rmi) it comes back from a peer, same digest, pinned. Stock k3s
// (the DaemonSet not told of it) shows what happens without: the image only where its archive
// is, and gone once removed there.
func (c *cluster) fleet(r *clusterReport, ready time.Time) {
	c.t.Helper()
	agent1 := c.agents()[0]
	const scenario = "fleet image (51 MiB archive on agent-1 only, --embedded-registry)"
	for _, n := range c.nodes {
		if c.mode.daemonSet {
			r.set(scenario+": started", n.name, c.sharedCell(n))
			continue
		}
		n.await(4*time.Minute, n.name+": "+c.shared+" present and pinned", func() bool {
			return n.present(c.shared)[c.shared] && n.criPinned(c.shared)
		})
		cell := "present, pinned (its archive)"
		if n != agent1 {
			cell = fmt.Sprintf("present, pinned by %s after every node was Ready; %s", time.Since(ready).Round(time.Second), c.awaitFetchedEvent(n))
		}
		r.set(scenario+": started", n.name, cell)
	}
	c.runShared()
	var pods map[string][]string
	c.server().await(3*time.Minute, "the fleet image's pods settled", func() bool {
		pods = c.pods(clusterSharedName)
		if c.mode.daemonSet {
			return slices.Contains(pods[agent1.name], "Running") && slices.Contains(pods[c.server().name], "ErrImageNeverPull")
		}
		return runningOn(pods, c.nodes)
	})
	for _, n := range c.nodes {
		r.set(scenario+": a pod on each node, imagePullPolicy Never", n.name, strings.Join(pods[n.name], ", "))
	}
	c.mustKubectl("delete", "daemonset", clusterSharedName, "--wait=true")
	c.server().await(2*time.Minute, "the fleet image's pods gone", func() bool { return len(c.pods(clusterSharedName)) == 0 })

	// The archive deleted to save disk, then the image removed on agent-1.
	if err := os.Remove(filepath.Join(agent1.imagesDir, clusterSharedArchive)); err != nil {
		c.t.Fatal(err)
	}
	if !c.mode.daemonSet {
		// The rmi after the removal is followed, so that the row reads the same on a loaded node
		// (the race of the two is TestArchiveRemovedJustBeforeItsImageIsDeleted's).
		state := filepath.Join(agent1.data, "agent", "k3s-pinning", "state.json")
		agent1.await(time.Minute, clusterSharedArchive+" retained in "+agent1.name+"'s state", func() bool {
			s, err := statefile.Load(state)
			return err == nil && s.Retained[clusterSharedArchive] != nil && s.Retained[clusterSharedArchive].Refs[clusterSharedRef] != ""
		})
	}
	if out, err := agent1.crictl("rmi", c.shared); err != nil {
		c.t.Fatalf("%s: crictl rmi %s: %v\n%s", agent1.name, c.shared, err, out)
	}
	removed := time.Now()
	const deleted = scenario + ": archive deleted on agent-1, then crictl rmi there"
	if c.mode.daemonSet {
		time.Sleep(30 * time.Second)
		for _, n := range c.nodes {
			r.set(deleted, n.name, c.sharedCell(n)+" (30 s after the rmi)")
		}
		return
	}
	back := agent1.await(3*time.Minute, c.shared+" back on "+agent1.name+" from a peer", func() bool {
		return agent1.present(c.shared, clusterSharedRef)[c.shared] && agent1.criPinned(c.shared)
	})
	cell := fmt.Sprintf("back from a peer %s after the rmi, same digest, pinned", back.Round(100*time.Millisecond))
	// agent-1 retains what the deleted archive provided: the tag comes back with the image, made
	// once the pull has ended (the digest reference is pinned as soon as the pull creates it).
	agent1.await(30*time.Second, clusterSharedRef+" back and pinned although its archive is retained", func() bool {
		return agent1.present(clusterSharedRef)[clusterSharedRef] && agent1.criPinned(clusterSharedRef)
	})
	cell += "; its tag too (retained); " + c.awaitFetchedEvent(agent1)
	r.set(deleted, agent1.name, cell)
	c.t.Logf("%s: %s back %s after the rmi (removed at %s)", agent1.name, c.shared, back.Round(100*time.Millisecond), removed.Format(time.TimeOnly))
}

// runShared runs the fleet's image on every node: a DaemonSet naming it by digest, Never pulled.
func (c *cluster) runShared() {
	c.t.Helper()
	c.apply(clusterSharedName, fmt.Sprintf(`apiVersion: apps/v1
kind: DaemonSet
metadata: {name: %[1]s, namespace: default}
spec:
  selector: {matchLabels: {app: %[1]s}}
  template:
    metadata: {labels: {app: %[1]s}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - {name: main, image: %[2]s, imagePullPolicy: Never}
`, clusterSharedName, c.shared))
}

// sharedCell says where the fleet's image is on n: present and pinned, present, or not there.
func (c *cluster) sharedCell(n *clusterNode) string {
	switch {
	case !n.present(c.shared)[c.shared]:
		return "NOT THERE"
	case n.criPinned(c.shared):
		return "present, pinned"
	default:
		return "present, NOT pinned"
	}
}

// awaitFetchedEvent is the newest ImageFetched Event of n naming the fleet's image, once the
// cluster shows it (the agent reports it after the pull's end; it reaches the API server a moment
// later): how long the pull took.
func (c *cluster) awaitFetchedEvent(n *clusterNode) string {
	c.t.Helper()
	var event string
	c.server().await(30*time.Second, "an ImageFetched Event of "+n.name+" naming "+c.shared, func() bool {
		event = c.lastFetchedEvent(n)
		return event != ""
	})
	return event
}

// lastFetchedEvent is the newest ImageFetched Event of n naming the fleet's image, or "" while
// the cluster shows none.
func (c *cluster) lastFetchedEvent(n *clusterNode) string {
	out, err := c.kubectl("get", "events", "-A", "--field-selector", "involvedObject.kind=Node,involvedObject.name="+n.name+",reason=ImageFetched",
		"--sort-by=.lastTimestamp", "-o", "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}")
	if err != nil {
		c.t.Logf("ImageFetched Events of %s: %v", n.name, err)
		return ""
	}
	var last string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if strings.Contains(line, c.shared) {
			last = line
		}
	}
	if _, after, ok := strings.Cut(last, " in "); ok {
		took, _, _ := strings.Cut(after, " ")
		return "its ImageFetched Event: pulled in " + took
	}
	return ""
}

// holders are the nodes whose status.images (the kubelet's report) list ref.
func (c *cluster) holders(ref string) []string {
	out, err := c.kubectl("get", "nodes", "-o", `jsonpath={range .items[*]}{.metadata.name}{"\t"}{range .status.images[*]}{range .names[*]}{@}{" "}{end}{end}{"\n"}{end}`)
	if err != nil {
		c.t.Logf("node.status.images: %v", err)
		return nil
	}
	var names []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		node, images, _ := strings.Cut(line, "\t")
		if slices.Contains(strings.Fields(images), ref) {
			names = append(names, strings.TrimPrefix(node, "k3sp-"))
		}
	}
	return names
}
