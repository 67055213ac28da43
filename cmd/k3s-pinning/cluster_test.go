package main_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestClusterUsageErrors: the cluster view's bad input exits 2 naming the flag or the file,
// before anything runs (no containerd, no API server needed).
func TestClusterUsageErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "no-such-kubeconfig")
	garbage := filepath.Join(t.TempDir(), "garbage.yaml")
	if err := os.WriteFile(garbage, []byte("not: [a kubeconfig"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		env  string
		want []string
	}{
		{[]string{"status", "--cluster", "--kubeconfig", missing}, "", []string{"status --cluster", missing}},
		{[]string{"status", "--cluster", "--kubeconfig", garbage}, "", []string{"status --cluster", garbage}},
		// --cluster is a boolean: it never takes the flag after it as its value (it once did)
		{[]string{"status", "--cluster", "--kubeconfig", missing, "-o", "json"}, "", []string{"kubeconfig " + missing}},
		{[]string{"status", "--cluster", "-o", "json", "--kubeconfig", missing}, "", []string{"kubeconfig " + missing}},
		// $KUBECONFIG is read when the flag is not given
		{[]string{"status", "--cluster"}, missing, []string{missing}},
		{[]string{"run", "--pinned-workload-images", "--pinned-workload-namespaces", "tenant", "--containerd-address", missing}, "", []string{"--pinned-workload-images", "--kubeconfig"}},
		// whose workloads count is the operator's to say: never every namespace by default
		{[]string{"run", "--pinned-workload-images", "--containerd-address", missing}, "", []string{"--pinned-workload-images", "--pinned-workload-namespaces"}},
		{[]string{"run", "--pinned-workload-images", "--pinned-workload-namespaces", "*", "--containerd-address", missing}, "", []string{"--pinned-workload-namespaces", `"*"`}},
		{[]string{"run", "--pinned-workload-images", "--pinned-workload-namespaces", "tenant", "--pinned-workload-selector", "a in (", "--containerd-address", missing}, "", []string{"--pinned-workload-selector", `"a in ("`}},
		{[]string{"run", "--pinned-workload-namespaces", "tenant", "--containerd-address", missing}, "", []string{"--pinned-workload-namespaces", "--pinned-workload-images"}},
		{[]string{"run", "--pinned-workload-images", "--pinned-workload-namespaces", "tenant", "--max-workload-images", "-1", "--containerd-address", missing}, "", []string{"--max-workload-images -1"}},
		{[]string{"run", "--pinned-workload-images", "--pinned-workload-namespaces", "tenant", "--max-workload-image-bytes", "lots", "--containerd-address", missing}, "", []string{"--max-workload-image-bytes", `"lots"`}},
		{[]string{"run", "--kubeconfig", missing, "--containerd-address", missing}, "", []string{"run:", missing}},
		{[]string{"run", "--kubeconfig", missing, "--in-cluster", "--node-name", "n1", "--containerd-address", missing}, "", []string{"--kubeconfig", "--in-cluster"}},
		// a pod's host name is not its node's: the node is named, or nothing runs
		{[]string{"run", "--in-cluster", "--containerd-address", missing}, "", []string{"--in-cluster", "--node-name", "NODE_NAME"}},
		// not in a pod: no service account to report with
		{[]string{"run", "--in-cluster", "--node-name", "n1", "--containerd-address", missing}, "", []string{"--in-cluster", "KUBERNETES_SERVICE_HOST"}},
	} {
		cmd := strings.Join(tc.args, " ")
		t.Setenv("KUBECONFIG", tc.env)
		_, stderr, code := run(t, tc.args...)
		if code != 2 {
			t.Errorf("%s: exit %d, want 2\n%s", cmd, code, stderr)
		}
		for _, w := range tc.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("%s: stderr does not name %q:\n%s", cmd, w, stderr)
			}
		}
	}
}
