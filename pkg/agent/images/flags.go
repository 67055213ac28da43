package images

import (
	"errors"
	"fmt"
	"strings"

	"github.com/docker/go-units"
	"github.com/urfave/cli/v2"

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
	// cluster (K3sConfig.WatchWorkloads, or the command's --kubeconfig) and the namespaces.
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

// K3sSettings are the values of the flags a patched k3s adds to `k3s agent` and `k3s server`
// (both run an agent), plain: K3sFlags fills them as the command line is parsed.
type K3sSettings struct {
	// DisableImagePinning leaves the images dir to k3s's own import: no pins set at creation, no
	// restore, no kubelet GC filter.
	DisableImagePinning bool
	// DisableImageRestore keeps pinning but does not re-import a deleted image from its archive.
	DisableImageRestore bool
	PolicyValues
}

// Check checks the values, naming the flag of a bad one, and returns the policy they describe.
func (s K3sSettings) Check() (*pinning.Policy, error) {
	if s.DisableImagePinning && (len(s.PinnedImages) > 0 || len(s.PinnedImageLabels) > 0 || s.PinnedWorkloadImages || s.FetchMissingImages || s.RetainRemovedArchiveImages) {
		return nil, fmt.Errorf("--%s, --%s, --%s, --%s and --%s need image pinning; remove them or --%s", FlagPinnedImages, FlagPinnedImageLabels, FlagPinnedWorkloadImages, FlagFetchMissingImages, FlagRetainRemoved, FlagDisableImagePinning)
	}
	return s.Policy()
}

// PolicyFlags are the policy flags, written for urfave/cli/v2 as k3s writes its own. Once the
// command line is parsed, v holds their values; a malformed value stops the command before its
// action runs, with an error naming the flag. Each call returns new flags: urfave flags keep
// per-parse state and must not be shared between commands. envPrefix is k3s's
// version.ProgramUpper ("K3S", or "RKE2" in rke2).
func PolicyFlags(v *PolicyValues, envPrefix string) []cli.Flag {
	return actions(policyFlags(envPrefix), func(c *cli.Context) error {
		*v = policyValues(c)
		_, err := v.Policy()
		return err
	})
}

// K3sFlags are the k3s-pinning flags of one k3s command, to append to its flags (call it once
// per command, with the same settings). Every one is also an envPrefix_ environment variable and
// a key of /etc/rancher/k3s/config.yaml, as every k3s flag is. Once the command line is parsed, s
// holds their values; a bad value stops k3s before it starts anything, with an error naming the
// flag (k3s exits 1 on a parse error; the agent, once started, could only request a shutdown).
func K3sFlags(s *K3sSettings, envPrefix string) []cli.Flag {
	flags := append([]cli.Flag{
		&cli.BoolFlag{Name: FlagDisableImagePinning, EnvVars: envVars(envPrefix, FlagDisableImagePinning),
			Usage: "(agent/images) Import agent/images as k3s does without k3s-pinning: no pin at creation, no restore, no kubelet image GC filter"},
		&cli.BoolFlag{Name: FlagDisableImageRestore, EnvVars: envVars(envPrefix, FlagDisableImageRestore),
			Usage: "(agent/images) Keep air-gap images pinned, but do not re-import one that was deleted from its archive"},
	}, policyFlags(envPrefix)...)
	return actions(flags, func(c *cli.Context) error {
		*s = K3sSettings{
			DisableImagePinning: c.Bool(FlagDisableImagePinning),
			DisableImageRestore: c.Bool(FlagDisableImageRestore),
			PolicyValues:        policyValues(c),
		}
		_, err := s.Check()
		return err
	})
}

func policyFlags(envPrefix string) []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{Name: FlagPinnedImages, EnvVars: envVars(envPrefix, FlagPinnedImages),
			Usage: "(agent/images) Keep these images too, e.g. hand imports: repo:tag, repo@digest, bare repo (every tag), or glob (registry.local/*)"},
		&cli.StringSliceFlag{Name: FlagPinnedImageLabels, EnvVars: envVars(envPrefix, FlagPinnedImageLabels),
			Usage: "(agent/images) Keep images carrying these containerd labels: key or key=value"},
		&cli.BoolFlag{Name: FlagPinnedWorkloadImages, EnvVars: envVars(envPrefix, FlagPinnedWorkloadImages),
			Usage: "(agent/images) Keep every image a workload in --" + FlagWorkloadNamespaces + " references (Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs, CronJobs, Pods), scaled to zero or not; needs list and watch on them there"},
		&cli.StringSliceFlag{Name: FlagWorkloadNamespaces, EnvVars: envVars(envPrefix, FlagWorkloadNamespaces),
			Usage: "(agent/images) The namespaces whose workloads --" + FlagPinnedWorkloadImages + " keeps (required with it)"},
		&cli.StringFlag{Name: FlagWorkloadSelector, EnvVars: envVars(envPrefix, FlagWorkloadSelector),
			Usage: "(agent/images) Only the workloads whose labels match this selector count, e.g. k3s-pinning.io/keep=true"},
		&cli.IntFlag{Name: FlagMaxWorkloadImages, EnvVars: envVars(envPrefix, FlagMaxWorkloadImages), Value: DefaultMaxWorkloadImages,
			Usage: "(agent/images) Keep and fetch at most this many image references for workloads; each one refused is a WorkloadImageRefused Event"},
		&cli.StringFlag{Name: FlagMaxWorkloadImageBytes, EnvVars: envVars(envPrefix, FlagMaxWorkloadImageBytes),
			Usage: "(agent/images) Keep and fetch at most this many bytes of images for workloads, e.g. 20Gi (a fetch is stopped once its manifest tells its size)"},
		&cli.BoolFlag{Name: FlagFetchMissingImages, EnvVars: envVars(envPrefix, FlagFetchMissingImages),
			Usage: "(agent/images) Fetch a wanted image that is missing and that no archive here provides (--pinned-images by digest, retained, a workload's by digest) through the CRI, by digest: registries.yaml mirrors and the embedded registry's peers apply"},
		&cli.BoolFlag{Name: FlagRetainRemoved, EnvVars: envVars(envPrefix, FlagRetainRemoved),
			Usage: "(agent/images) Keep the images of an archive removed from the images dir pinned, as retained, until `k3s-pinning unpin`; a deleted one is fetched (--fetch-missing-images)"},
		&cli.IntFlag{Name: FlagFetchMaxDiskUsage, EnvVars: envVars(envPrefix, FlagFetchMaxDiskUsage), Value: DefaultFetchMaxDiskUsage,
			Usage: "(agent/images) Start no fetch, and pin no new workload image, while the image filesystem is used above this percent (the kubelet's image GC high threshold)"},
	}
}

// envVars is the variable k3s reads a flag from: K3S_PINNED_IMAGES for --pinned-images.
func envVars(envPrefix, flag string) []string {
	return []string{envPrefix + "_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))}
}

func policyValues(c *cli.Context) PolicyValues {
	return PolicyValues{PinnedImages: c.StringSlice(FlagPinnedImages), PinnedImageLabels: c.StringSlice(FlagPinnedImageLabels), PinnedWorkloadImages: c.Bool(FlagPinnedWorkloadImages),
		WorkloadNamespaces: c.StringSlice(FlagWorkloadNamespaces), WorkloadSelector: c.String(FlagWorkloadSelector), MaxWorkloadImages: c.Int(FlagMaxWorkloadImages),
		MaxWorkloadImageBytes: c.String(FlagMaxWorkloadImageBytes),
		FetchMissingImages:    c.Bool(FlagFetchMissingImages), RetainRemovedArchiveImages: c.Bool(FlagRetainRemoved), FetchMaxDiskUsage: c.Int(FlagFetchMaxDiskUsage)}
}

// actions makes every flag that is set (on the command line, in the environment or the config
// file) read all the values and check them, once parsing is done: whichever flags are given, the
// values are read and checked whole, before the command's action.
func actions(flags []cli.Flag, read func(*cli.Context) error) []cli.Flag {
	for _, f := range flags {
		switch f := f.(type) {
		case *cli.BoolFlag:
			f.Action = func(c *cli.Context, _ bool) error { return read(c) }
		case *cli.StringSliceFlag:
			f.Action = func(c *cli.Context, _ []string) error { return read(c) }
		case *cli.IntFlag:
			f.Action = func(c *cli.Context, _ int) error { return read(c) }
		case *cli.StringFlag:
			f.Action = func(c *cli.Context, _ string) error { return read(c) }
		}
	}
	return flags
}
