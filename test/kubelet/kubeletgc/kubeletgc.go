// Package kubeletgc runs the kubelet's real image garbage collector
// (k8s.io/kubernetes/pkg/kubelet/images.ImageGCManager) against a real containerd's CRI image
// service, with image-filesystem usage set by the caller. It exists so that tests and the demo
// exercise the exact code that deletes images on a node, not a model of it.
package kubeletgc

import (
	"context"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/keep"
	"go.opentelemetry.io/otel/trace/noop"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	statsapi "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	"k8s.io/kubernetes/pkg/kubelet/images"
)

// CRIRuntime is the part of the kubelet's container.Runtime that the image GC calls (ListImages,
// GetPods, GetContainerStatus, RemoveImage), served by the CRI as kuberuntime serves it. Any
// other method panics on the nil embedded interface: the GC must not call them.
type CRIRuntime struct {
	kubecontainer.Runtime
	images  runtimeapi.ImageServiceClient
	runtime runtimeapi.RuntimeServiceClient
}

// NewCRIRuntime talks CRI over conn (containerd serves the CRI on its own socket).
func NewCRIRuntime(conn *grpc.ClientConn) *CRIRuntime {
	return &CRIRuntime{images: runtimeapi.NewImageServiceClient(conn), runtime: runtimeapi.NewRuntimeServiceClient(conn)}
}

// ListImages converts CRI images as kuberuntime's ListImages and ToKubeContainerImageSpec do,
// Pinned included: that field is what the GC skips.
func (r *CRIRuntime) ListImages(ctx context.Context) ([]kubecontainer.Image, error) {
	resp, err := r.images.ListImages(ctx, &runtimeapi.ListImagesRequest{})
	if err != nil {
		return nil, err
	}
	var out []kubecontainer.Image
	for _, img := range resp.Images {
		spec := kubecontainer.ImageSpec{Image: img.Id}
		if img.Spec != nil {
			spec.RuntimeHandler = img.Spec.RuntimeHandler
		}
		out = append(out, kubecontainer.Image{
			ID: img.Id, Size: int64(img.Size), RepoTags: img.RepoTags, RepoDigests: img.RepoDigests,
			Spec: spec, Pinned: img.Pinned,
		})
	}
	return out, nil
}

// GetPods groups the CRI's containers by sandbox, with image IDs as kuberuntime's toKubeContainer
// sets them: the images in use are never collected.
func (r *CRIRuntime) GetPods(ctx context.Context, all bool) ([]*kubecontainer.Pod, error) {
	resp, err := r.runtime.ListContainers(ctx, &runtimeapi.ListContainersRequest{})
	if err != nil {
		return nil, err
	}
	pods := map[string]*kubecontainer.Pod{}
	var out []*kubecontainer.Pod
	for _, c := range resp.Containers {
		if c.Image == nil {
			continue
		}
		pod, ok := pods[c.PodSandboxId]
		if !ok {
			pod = &kubecontainer.Pod{ID: types.UID(c.PodSandboxId)}
			pods[c.PodSandboxId] = pod
			out = append(out, pod)
		}
		imageID := c.ImageRef
		if c.ImageId != "" {
			imageID = c.ImageId
		}
		pod.Containers = append(pod.Containers, &kubecontainer.Container{
			ID: kubecontainer.ContainerID{Type: "containerd", ID: c.Id}, Name: c.GetMetadata().GetName(),
			ImageID: imageID, ImageRef: c.ImageRef, ImageRuntimeHandler: c.Image.RuntimeHandler, Image: c.Image.Image,
			PodSandboxID: c.PodSandboxId,
		})
	}
	return out, nil
}

// GetContainerStatus returns the mounts of a container: the GC reads them for image volumes.
func (r *CRIRuntime) GetContainerStatus(ctx context.Context, _ types.UID, id kubecontainer.ContainerID) (*kubecontainer.Status, error) {
	resp, err := r.runtime.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id.ID})
	if err != nil {
		return nil, err
	}
	status := &kubecontainer.Status{ID: id}
	for _, m := range resp.GetStatus().GetMounts() {
		status.Mounts = append(status.Mounts, kubecontainer.Mount{ContainerPath: m.ContainerPath, HostPath: m.HostPath, Image: m.Image})
	}
	return status, nil
}

// RemoveImage removes an image through the CRI, as the kubelet does (every reference of it goes).
func (r *CRIRuntime) RemoveImage(ctx context.Context, image kubecontainer.ImageSpec) error {
	_, err := r.images.RemoveImage(ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: image.Image}})
	return err
}

// DiskUsage is an image filesystem whose fullness the caller sets: the GC frees images until
// usage is under its low threshold, so 95% full with an 80% low threshold asks it to free 15% of
// Capacity.
type DiskUsage struct {
	Capacity    uint64
	UsedPercent int
}

// ImageFsStats implements images.StatsProvider.
func (d *DiskUsage) ImageFsStats(context.Context) (*statsapi.FsStats, *statsapi.FsStats, error) {
	used := d.Capacity * uint64(d.UsedPercent) / 100
	avail := d.Capacity - used
	fs := &statsapi.FsStats{Time: metav1.Now(), CapacityBytes: &d.Capacity, AvailableBytes: &avail, UsedBytes: &used}
	return fs, fs, nil
}

// Policy is the kubelet's default image GC policy (imageGCHighThresholdPercent 85, low 80),
// with no minimum age so that images imported a moment ago are candidates, as after 2 minutes
// on a node.
func Policy() images.ImageGCPolicy {
	return images.ImageGCPolicy{HighThresholdPercent: 85, LowThresholdPercent: 80}
}

// NewManager returns the kubelet's real ImageGCManager on runtime and disk.
func NewManager(runtime *CRIRuntime, disk *DiskUsage, policy images.ImageGCPolicy) (images.ImageGCManager, error) {
	node := &v1.ObjectReference{Kind: "Node", Name: "k3s-pinning-test", UID: "k3s-pinning-test"}
	return images.NewImageGCManager(runtime, disk, nil, record.NewFakeRecorder(100), node, policy, noop.NewTracerProvider())
}

// FilterName is the name k3s-pinning registers its kubelet image GC filter under.
const FilterName = "k3s-pinning"

// RegisterFilter registers keeper as the kubelet's image GC filter (patches/kubernetes), as a
// patched k3s does before its kubelet starts, and returns the function that removes it.
func RegisterFilter(keeper *keep.Keeper) (unregister func()) {
	images.RegisterGCFilter(FilterName, func(img kubecontainer.Image) bool {
		return keeper.Keep(img.ID, img.RepoTags, img.RepoDigests)
	})
	return func() { images.RegisterGCFilter(FilterName, nil) }
}
