package images_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// node is a real containerd with an images dir beside it.
type node struct {
	t         *testing.T
	ctx       context.Context
	daemon    *containerdtest.Daemon
	client    *containerd.Client
	cri       runtimeapi.ImageServiceClient
	imagesDir string
}

// anyDiskUsage is --fetch-max-disk-usage for the tests whose point is not the disk: a new
// workload pin is held back while the image filesystem is above it, and the test's containerd
// keeps its images on this machine's disk, whatever else fills it.
const anyDiskUsage = 100

func newNode(t *testing.T) *node {
	t.Helper()
	return newNodeWith(t, containerdtest.Options{})
}

func newNodeWith(t *testing.T, opts containerdtest.Options) *node {
	t.Helper()
	d := containerdtest.New(t, opts)
	client, err := d.Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	ctx, cancel := context.WithTimeout(namespaces.WithNamespace(context.Background(), pinning.DefaultNamespace), 5*time.Minute)
	t.Cleanup(cancel)
	dir := filepath.Join(t.TempDir(), "images")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return &node{t: t, ctx: ctx, daemon: d, client: client, imagesDir: dir,
		cri: runtimeapi.NewImageServiceClient(client.Conn().(*grpc.ClientConn))}
}

func (n *node) agent(policy *pinning.Policy) *images.Agent {
	return images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, Policy: policy})
}

// criPinned asks the CRI, as the kubelet does, whether ref exists and is pinned. The CRI's view
// of labels can lag the metadata store by a moment, so a pinned answer is awaited for up to 2 s.
func (n *node) criPinned(ref string) (present, pinned bool) {
	n.t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		resp, err := n.cri.ImageStatus(n.ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
		if err != nil {
			n.t.Fatalf("CRI ImageStatus %s: %v", ref, err)
		}
		img := resp.GetImage()
		if (img != nil && img.Pinned) || time.Now().After(deadline) {
			return img != nil, img != nil && img.Pinned
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (n *node) labels(ref string) map[string]string {
	n.t.Helper()
	img, err := n.client.ImageService().Get(n.ctx, ref)
	if err != nil {
		n.t.Fatalf("get %s: %v", ref, err)
	}
	return img.Labels
}

// leased is n's context with a lease of its own, deleted when the test ends: what is written
// under it stays until then, as a pulled image's blobs stay under the image.
func (n *node) leased() context.Context {
	n.t.Helper()
	lease, err := n.client.LeasesService().Create(n.ctx, leases.WithRandomID())
	if err != nil {
		n.t.Fatal(err)
	}
	n.t.Cleanup(func() { n.client.LeasesService().Delete(n.ctx, lease) })
	return leases.WithLease(n.ctx, lease.ID)
}

// collectGarbage runs containerd's GC to its end: what no image's GC labels or lease reach is
// gone after it.
func (n *node) collectGarbage() {
	n.t.Helper()
	lease, err := n.client.LeasesService().Create(n.ctx, leases.WithRandomID())
	if err != nil {
		n.t.Fatal(err)
	}
	if err := n.client.LeasesService().Delete(n.ctx, lease, leases.SynchronousDelete); err != nil {
		n.t.Fatal(err)
	}
}
