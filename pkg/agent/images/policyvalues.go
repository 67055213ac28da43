package images

import (
	"errors"
	"fmt"

	"github.com/docker/go-units"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Flag names: a contract, as k3s's own flags are (command line, K3S_ variables, config.yaml keys).
const (
	FlagPinnedImages          = "pinned-images"
	FlagPinnedImageLabels     = "pinned-image-labels"
	FlagDisableImagePinning   = "disable-image-pinning"
	FlagDisableImageRestore   = "disable-image-restore"
	FlagPinnedWorkloadImages  = "pinned-workload-images"
	FlagFetchMissingImages    = "fetch-missing-images"
	FlagRetainRemoved         = "retain-removed-archive-images"
	FlagFetchMaxDiskUsage     = "fetch-max-disk-usage"
	FlagWorkloadNamespaces    = "pinned-workload-namespaces"
	FlagWorkloadSelector      = "pinned-workload-selector"
	FlagMaxWorkloadImages     = "max-workload-images"
	FlagMaxWorkloadImageBytes = "max-workload-image-bytes"
)

// DefaultFetchMaxDiskUsage is the kubelet's default image GC high threshold (percent): a fetch
// that starts above it would cause the very pressure it protects against.
const DefaultFetchMaxDiskUsage = 85

// DefaultMaxWorkloadImages bounds what the workloads in scope make a node keep: a tenant allowed
// to create a Deployment decides what it names.
const DefaultMaxWorkloadImages = 100

// PolicyValues are the values of the policy flags, plain.
type PolicyValues struct {
	PinnedImages      []string
	PinnedImageLabels []string
	// PinnedWorkloadImages keeps every image a workload in scope references; it needs the
	// cluster (k3spinning.Config.WatchWorkloads, or the command's --kubeconfig) and the namespaces.
	PinnedWorkloadImages bool
	// WorkloadNamespaces and WorkloadSelector are whose workloads count: the namespaces (each
	// grants the node's credentials list and watch there), and a label selector their objects
	// must match ("": all).
	WorkloadNamespaces []string
	WorkloadSelector   string
	// MaxWorkloadImages bounds the references kept (and fetched) for workloads and nothing else
	// (0: DefaultMaxWorkloadImages); MaxWorkloadImageBytes their images' bytes, as a size with a
	// binary unit ("20Gi"; "": no bound).
	MaxWorkloadImages     int
	MaxWorkloadImageBytes string
	// FetchMissingImages fetches a wanted image that is missing and that no archive of this node
	// provides (named by digest in --pinned-images, a retained archive's, a workload's named by
	// digest) through the CRI, by digest: registries.yaml mirrors and k3s's embedded registry
	// (peers) apply. Off: such an image is pinned only once something imports it.
	FetchMissingImages bool
	// RetainRemovedArchiveImages keeps what an archive removed from the images dir provided
	// pinned, recorded as retained, until `k3s-pinning unpin` (k3s issue 11363: the images dir
	// doubles what the content store holds). Off: a removed archive's images are unpinned.
	RetainRemovedArchiveImages bool
	// FetchMaxDiskUsage: no fetch starts while the image filesystem is used above this percent
	// (0: DefaultFetchMaxDiskUsage). Set it to the kubelet's --image-gc-high-threshold if changed.
	FetchMaxDiskUsage int
}

// Policy parses the values; a malformed one is an error naming its flag and the value.
func (v PolicyValues) Policy() (*pinning.Policy, error) {
	p, err := pinning.NewPolicy(v.PinnedImages, v.PinnedImageLabels)
	var pe *pinning.PolicyError
	if errors.As(err, &pe) {
		flag := FlagPinnedImages
		if pe.Label {
			flag = FlagPinnedImageLabels
		}
		return nil, fmt.Errorf("--%s %q: %w", flag, pe.Value, pe.Err)
	}
	if v.FetchMaxDiskUsage < 0 || v.FetchMaxDiskUsage > 100 {
		return nil, fmt.Errorf("--%s %d: a percentage of the image filesystem, 1 to 100", FlagFetchMaxDiskUsage, v.FetchMaxDiskUsage)
	}
	if err == nil {
		err = v.checkWorkloadScope()
	}
	return p, err
}

// maxWorkloadImageBytes is MaxWorkloadImageBytes in bytes (0: no bound).
func (v PolicyValues) maxWorkloadImageBytes() (int64, error) {
	if v.MaxWorkloadImageBytes == "" {
		return 0, nil
	}
	n, err := units.RAMInBytes(v.MaxWorkloadImageBytes)
	if err == nil && n < 0 {
		err = errors.New("negative")
	}
	if err != nil {
		return 0, fmt.Errorf("--%s %q: a size such as 20Gi or 512Mi: %w", FlagMaxWorkloadImageBytes, v.MaxWorkloadImageBytes, err)
	}
	return n, nil
}

// WorkloadScope is whose workloads count, as the flags say.
func (v PolicyValues) WorkloadScope() WorkloadScope {
	return WorkloadScope{Namespaces: v.WorkloadNamespaces, Selector: v.WorkloadSelector}
}

// checkWorkloadScope refuses --pinned-workload-images without namespaces: no node credential
// reads workloads cluster-wide (the namespaces are where the operator grants it), and the
// operator says whose workloads decide what every node keeps. The selector's syntax is checked
// by the watcher (pkg/agent/cluster), which knows Kubernetes's.
func (v PolicyValues) checkWorkloadScope() error {
	scoped := len(v.WorkloadNamespaces) > 0 || v.WorkloadSelector != "" || v.MaxWorkloadImageBytes != ""
	if _, err := v.maxWorkloadImageBytes(); err != nil {
		return err
	}
	switch {
	case v.PinnedWorkloadImages && len(v.WorkloadNamespaces) == 0:
		return fmt.Errorf("--%s needs --%s: the namespaces whose workloads count (the node's credentials may list and watch them there, deploy/k3s-pinning-workloads.yaml)", FlagPinnedWorkloadImages, FlagWorkloadNamespaces)
	case !v.PinnedWorkloadImages && scoped:
		return fmt.Errorf("--%s, --%s and --%s apply to --%s, which is not set", FlagWorkloadNamespaces, FlagWorkloadSelector, FlagMaxWorkloadImageBytes, FlagPinnedWorkloadImages)
	case v.MaxWorkloadImages < 0:
		return fmt.Errorf("--%s %d: a count of image references, 1 or more", FlagMaxWorkloadImages, v.MaxWorkloadImages)
	}
	for _, ns := range v.WorkloadNamespaces {
		if ns == "" || ns == "*" {
			return fmt.Errorf("--%s %q: a namespace's name (workloads are never read cluster-wide)", FlagWorkloadNamespaces, ns)
		}
	}
	return nil
}
