package e2e_test

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// agentRef is the k3s-pinning image the test builds with make release's image writer.
const agentRef = "docker.io/k3s-pinning/k3s-pinning:e2e"

// repoRoot is the k3s-pinning module, two levels up from test/e2e.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// goInRoot runs go in the k3s-pinning module itself (not this test's vendored workspace).
func goInRoot(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir = repoRoot(t)
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// writeAgentImage writes the k3s-pinning image archive to out as make release does: the static
// binary (-trimpath -s -w, CGO off), in an image written by build/release-image. It returns the
// binary.
func writeAgentImage(t *testing.T, out string) string {
	t.Helper()
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(cache, "k3s-pinning", "e2e", "k3s-pinning-static")
	goInRoot(t, "build", "-trimpath", "-ldflags", "-s -w -X main.version=e2e", "-o", bin, "./cmd/k3s-pinning")
	goInRoot(t, "run", "./build/release-image", "-ref", agentRef, "-version", "e2e", "-out", out, "linux/amd64="+bin)
	return bin
}

// deployAgentPod puts k3s-pinning on the node as an operator does with make release's artifacts:
// the image archive (the static binary, as build/release-image writes it) in the images dir,
// loaded by `k3s-pinning sync` before the kubelet starts (k3s imports agent/images before its
// kubelet), and deploy/k3s-pinning.yaml's pod template as a static pod, with the hostPath mounts
// pointing at this node's containerd, images dir and state dir. Changes, because the e2e node
// has no CNI: host network, and the metrics port a free one (the liveness probe's); and because
// it has no API server: no service account, no --in-cluster (the cluster e2e runs the DaemonSet
// as it is, reporting).
func (n *node) deployAgentPod() {
	n.t.Helper()
	bin := writeAgentImage(n.t, filepath.Join(n.imagesDir, "k3s-pinning-image.tar"))
	stateDir := filepath.Join(n.dir, "state")
	n.run(bin, "sync", "--containerd-address", n.daemon.Address, "--images-dir", n.imagesDir, "--state-file", filepath.Join(stateDir, "state.json"))

	data, err := os.ReadFile(filepath.Join(repoRoot(n.t), "deploy", "k3s-pinning.yaml"))
	if err != nil {
		n.t.Fatal(err)
	}
	var ds appsv1.DaemonSet
	for _, doc := range strings.Split(string(data), "\n---\n") {
		if strings.Contains(doc, "kind: DaemonSet") {
			if err := yaml.UnmarshalStrict([]byte(doc), &ds); err != nil {
				n.t.Fatalf("deploy/k3s-pinning.yaml: %v", err)
			}
		}
	}
	if ds.Name == "" {
		n.t.Fatal("deploy/k3s-pinning.yaml holds no DaemonSet")
	}
	spec := ds.Spec.Template.Spec.DeepCopy()
	spec.HostNetwork = true
	spec.ServiceAccountName, spec.AutomountServiceAccountToken = "", nil
	port := freePort(n.t)
	n.agentMetrics = fmt.Sprintf("http://127.0.0.1:%d/metrics", port)
	hostPaths := map[string]string{"containerd": n.daemon.Address, "images": n.imagesDir, "state": stateDir}
	for i, v := range spec.Volumes {
		path, ok := hostPaths[v.Name]
		if !ok || v.HostPath == nil {
			n.t.Fatalf("deploy/k3s-pinning.yaml: volume %q is not one of the hostPaths the test knows", v.Name)
		}
		spec.Volumes[i].HostPath.Path = path
	}
	c := &spec.Containers[0]
	// make release writes its image's reference for __IMAGE__; the test's image stands in.
	if c.Image != "__IMAGE__" || c.ImagePullPolicy != corev1.PullNever {
		n.t.Fatalf("deploy/k3s-pinning.yaml: image %s, pull policy %s", c.Image, c.ImagePullPolicy)
	}
	c.Image = agentRef
	if !slices.Contains(c.Args, "--in-cluster") {
		n.t.Fatalf("deploy/k3s-pinning.yaml: the DaemonSet does not report with its service account: %v", c.Args)
	}
	c.Args = slices.DeleteFunc(c.Args, func(arg string) bool { return arg == "--in-cluster" })
	for i, arg := range c.Args {
		if strings.HasPrefix(arg, "--metrics-address=") {
			c.Args[i] = fmt.Sprintf("--metrics-address=0.0.0.0:%d", port)
		}
	}
	c.Ports[0].ContainerPort = int32(port)
	pod := corev1.Pod{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: "k3s-pinning", Namespace: ds.Namespace, Labels: ds.Spec.Template.Labels}, Spec: *spec}
	manifest, err := yaml.Marshal(pod)
	if err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(n.manifests, "k3s-pinning.yaml"), manifest, 0o644); err != nil {
		n.t.Fatal(err)
	}
}

// TestAgentAsPodKeepsAirgapImages: k3s-pinning as make release delivers it to a stock node (no
// agent in the kubelet's process, no GC filter): the DaemonSet's pod, run by the kubelet from
// the image archive k3s-pinning imported itself. It re-pins what is stripped while it runs, and
// through real disk pressure the kubelet's reclaim keeps every air-gap image, the agent's own
// included; the app's pod comes back.
func TestAgentAsPodKeepsAirgapImages(t *testing.T) {
	n := newNode(t, nodeOptions{agent: "off", filter: false, agentPod: true})
	r := &report{name: "agent as a pod: the DaemonSet's pod template, image from the images dir", extra: []string{agentRef}}
	defer r.print()
	n.await(2*time.Minute, "the k3s-pinning pod Running", func() bool { return n.podStateOf("k3s-pinning") == "Running" })
	refs := append(slices.Clone(airgapRefs), agentRef)
	for _, ref := range refs {
		if !n.criPinned(ref) {
			t.Errorf("%s not pinned after k3s-pinning sync", ref)
		}
	}
	// What its liveness probe asks (the probe's first call comes after 30 s): the pod's metrics.
	n.await(30*time.Second, "the k3s-pinning pod serving "+n.agentMetrics, func() bool {
		resp, err := http.Get(n.agentMetrics)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode == http.StatusOK && strings.Contains(string(body), "k3s_pinning_wanted_references")
	})
	// The pod, not the sync before it, keeps them: every pin stripped comes back.
	n.stripPins()
	n.await(30*time.Second, "the k3s-pinning pod pinning every air-gap image again", func() bool {
		return !slices.ContainsFunc(refs, func(ref string) bool { return !n.criPinned(ref) })
	})
	evictAndReclaim(n, r)
	requireProtected(t, r)
	if !r.after[agentRef] {
		t.Errorf("the agent's own image %s deleted by the reclaim", agentRef)
	}
	if state := n.podStateOf("k3s-pinning"); state != "Running" {
		t.Errorf("the k3s-pinning pod after the pressure: %s", state)
	}
	podComesBack(n, r)
}
