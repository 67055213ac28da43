package images

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/platforms"
	"github.com/docker/go-units"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// The disk guard: how full the image filesystem is, and what an image would add to it. It holds
// back fetches and new workload pins, never the archives' pins.

// DiskUsage is how full a filesystem is, as the kubelet measures it: Used is the capacity less
// what is available to unprivileged users.
type DiskUsage struct {
	Path           string
	Used, Capacity int64
}

// percent is how full the filesystem would be with extra bytes more.
func (u DiskUsage) percent(extra int64) float64 {
	if u.Capacity == 0 {
		return 0
	}
	return 100 * float64(u.Used+extra) / float64(u.Capacity)
}

// imagefsAbove reports whether the image filesystem, with extra bytes more, would be used above
// FetchMaxDiskUsage percent, as the kubelet's image GC high threshold measures it, and says so
// (why).
func (a *Agent) imagefsAbove(ctx context.Context, extra int64) (above bool, why string, err error) {
	limit := a.cfg.FetchMaxDiskUsage
	if limit <= 0 {
		limit = DefaultFetchMaxDiskUsage
	}
	usage := a.cfg.ImagefsUsage
	if usage == nil {
		usage = a.criImagefsUsage
	}
	u, err := usage(ctx)
	if err != nil {
		return false, "", err
	}
	now, with := u.percent(0), u.percent(extra)
	switch {
	case now > float64(limit):
		return true, fmt.Sprintf("image filesystem %s is %.0f%% used, above --%s %d%%", u.Path, now, FlagFetchMaxDiskUsage, limit), nil
	case with > float64(limit):
		return true, fmt.Sprintf("the image's %s would bring image filesystem %s from %.0f%% to %.0f%% used, above --%s %d%%",
			units.BytesSize(float64(extra)), u.Path, now, with, FlagFetchMaxDiskUsage, limit), nil
	}
	return false, "", nil
}

// criImagefsUsage is the CRI's image filesystem (ImageFsInfo's mount point, the fullest of
// them), measured by statfs.
func (a *Agent) criImagefsUsage(ctx context.Context) (DiskUsage, error) {
	resp, err := a.cd.CRI.ImageFsInfo(ctx, &runtimeapi.ImageFsInfoRequest{})
	if err != nil {
		return DiskUsage{}, fmt.Errorf("CRI ImageFsInfo: %w", err)
	}
	var worst DiskUsage
	for _, fs := range resp.GetImageFilesystems() {
		path := fs.GetFsId().GetMountpoint()
		u, err := fsUsage(path)
		if err != nil {
			return DiskUsage{}, fmt.Errorf("statfs %s: %w", path, err)
		}
		if worst.Path == "" || u.percent(0) > worst.percent(0) {
			worst = u
		}
	}
	if worst.Path == "" {
		return DiskUsage{}, errors.New("the CRI reports no image filesystem")
	}
	return worst, nil
}

// imageSize is the size of the image whose manifest (or index) has digest d, for this node's
// platform, as its descriptors give it (the bytes a pull downloads; unpacked it takes more),
// once containerd's content store holds its manifests: during a pull they come before the
// layers. An error wrapping errdefs.ErrNotFound means not yet.
func imageSize(ctx context.Context, cs content.Provider, d digest.Digest) (int64, error) {
	blob, err := content.ReadBlob(ctx, cs, ocispec.Descriptor{Digest: d})
	if err != nil {
		return 0, err
	}
	// The root's media type is not known from its digest; OCI manifests and indexes name it,
	// or have it told by their fields.
	var root struct {
		MediaType string               `json:"mediaType"`
		Manifests []ocispec.Descriptor `json:"manifests"`
	}
	if err := json.Unmarshal(blob, &root); err != nil {
		return 0, fmt.Errorf("manifest %s: %w", d, err)
	}
	if root.MediaType == "" {
		root.MediaType = ocispec.MediaTypeImageManifest
		if root.Manifests != nil {
			root.MediaType = ocispec.MediaTypeImageIndex
		}
	}
	img := images.Image{Target: ocispec.Descriptor{MediaType: root.MediaType, Digest: d, Size: int64(len(blob))}}
	return img.Size(ctx, cs, platforms.Default())
}
