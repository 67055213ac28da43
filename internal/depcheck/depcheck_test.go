package depcheck

import "testing"

// The packages meant to stay small: the archive reader reads files and bytes and talks to
// nothing; pkg/pinning, the policy and the one pin writer, works on containerd's images.Store
// interface, whoever implements it. Neither has a client, a CLI or metrics of its own, nor logs.
func TestDependencies(t *testing.T) {
	for _, pkg := range []string{
		"github.com/k3s-pinning/k3s-pinning/pkg/airgap",
		"github.com/k3s-pinning/k3s-pinning/pkg/pinning",
	} {
		Forbid(t, pkg,
			[]string{"github.com/containerd/containerd/v2/client", "google.golang.org/grpc", "github.com/urfave/cli", "github.com/prometheus", "k8s.io"},
			[]string{"github.com/sirupsen/logrus", "github.com/containerd/log"})
	}
}

// The agent reports to the cluster through its Reporter interface only: the Kubernetes client
// lives in pkg/agent/cluster, so that the agent's tests need no API server. Its flags live in
// pkg/k3spinning, the package k3s imports, which wires the two.
func TestAgentHasNoKubernetesClient(t *testing.T) {
	Forbid(t, "github.com/k3s-pinning/k3s-pinning/pkg/agent/images",
		[]string{"k8s.io/client-go", "k8s.io/api", "k8s.io/apimachinery", "github.com/urfave/cli"}, nil)
}

// The daemon reads and writes four API groups (pkg/agent/cluster's scheme), not client-go's
// clientset, whose typed clients, informers and listers register all of Kubernetes's: with them
// the binary is half as large again, and an idle daemon holds the pages they touch.
func TestDaemonHasNoClientset(t *testing.T) {
	Forbid(t, "github.com/k3s-pinning/k3s-pinning/cmd/k3s-pinning",
		[]string{"k8s.io/client-go/kubernetes", "k8s.io/client-go/informers", "k8s.io/client-go/listers", "k8s.io/client-go/applyconfigurations"}, nil)
}

// The image list is containerd's answer decoded, nothing more: no other package of this module,
// no logger, no client of anything but containerd's gRPC connection.
func TestImageListStandsAlone(t *testing.T) {
	Forbid(t, "github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist",
		[]string{"github.com/k3s-pinning/k3s-pinning/pkg/agent/images", "github.com/k3s-pinning/k3s-pinning/pkg/pinning",
			"github.com/k3s-pinning/k3s-pinning/pkg/airgap", "github.com/k3s-pinning/k3s-pinning/internal", "k8s.io", "github.com/prometheus"},
		[]string{"github.com/sirupsen/logrus", "github.com/containerd/log"})
}

// The state file is a file: no containerd client, no gRPC, no Kubernetes, no other package of the
// agent.
func TestStateFileIsAFile(t *testing.T) {
	Forbid(t, "github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile",
		[]string{"github.com/containerd/containerd/v2/client", "google.golang.org/grpc", "k8s.io", "github.com/prometheus",
			"github.com/k3s-pinning/k3s-pinning/pkg/agent/images", "github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"},
		[]string{"github.com/sirupsen/logrus"})
}

// The keep-decision is pure: no containerd client, no Kubernetes, no metrics, no logger, no other
// package of the agent but the state file's records and the image list it is asked about (whose
// package, which decodes containerd's answer, links gRPC's codec: keep calls none of it).
func TestKeepDecisionIsPure(t *testing.T) {
	Forbid(t, "github.com/k3s-pinning/k3s-pinning/pkg/agent/keep",
		[]string{"github.com/containerd/containerd/v2/client", "k8s.io", "github.com/prometheus",
			"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"},
		[]string{"github.com/sirupsen/logrus", "github.com/containerd/log"})
}
