package k3spinning

import (
	"fmt"
	"strings"

	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Settings are the values of the flags a patched k3s adds to `k3s agent` and `k3s server`
// (both run an agent), plain: Flags fills them as the command line is parsed.
type Settings struct {
	// DisableImagePinning leaves the images dir to k3s's own import: no pins set at creation, no
	// restore, no kubelet GC filter.
	DisableImagePinning bool
	// DisableImageRestore keeps pinning but does not re-import a deleted image from its archive.
	DisableImageRestore bool
	images.PolicyValues
}

// Check checks the values, naming the flag of a bad one, and returns the policy they describe.
func (s Settings) Check() (*pinning.Policy, error) {
	if s.DisableImagePinning && (len(s.PinnedImages) > 0 || len(s.PinnedImageLabels) > 0 || s.PinnedWorkloadImages || s.FetchMissingImages || s.RetainRemovedArchiveImages) {
		return nil, fmt.Errorf("--%s, --%s, --%s, --%s and --%s need image pinning; remove them or --%s", images.FlagPinnedImages, images.FlagPinnedImageLabels, images.FlagPinnedWorkloadImages, images.FlagFetchMissingImages, images.FlagRetainRemoved, images.FlagDisableImagePinning)
	}
	return s.Policy()
}

// PolicyFlags are the policy flags, written for urfave/cli/v2 as k3s writes its own. Once the
// command line is parsed, v holds their values; a malformed value stops the command before its
// action runs, with an error naming the flag. Each call returns new flags: urfave flags keep
// per-parse state and must not be shared between commands. envPrefix is k3s's
// version.ProgramUpper ("K3S", or "RKE2" in rke2).
func PolicyFlags(v *images.PolicyValues, envPrefix string) []cli.Flag {
	return actions(policyFlags(envPrefix), func(c *cli.Context) error {
		*v = policyValues(c)
		_, err := v.Policy()
		return err
	})
}

// Flags are the k3s-pinning flags of one k3s command, to append to its flags (call it once
// per command, with the same settings). Every one is also an envPrefix_ environment variable and
// a key of /etc/rancher/k3s/config.yaml, as every k3s flag is. Once the command line is parsed, s
// holds their values; a bad value stops k3s before it starts anything, with an error naming the
// flag (k3s exits 1 on a parse error; the agent, once started, could only request a shutdown).
func Flags(s *Settings, envPrefix string) []cli.Flag {
	flags := append([]cli.Flag{
		&cli.BoolFlag{Name: images.FlagDisableImagePinning, EnvVars: envVars(envPrefix, images.FlagDisableImagePinning),
			Usage: "(agent/images) Import agent/images as k3s does without k3s-pinning: no pin at creation, no restore, no kubelet image GC filter"},
		&cli.BoolFlag{Name: images.FlagDisableImageRestore, EnvVars: envVars(envPrefix, images.FlagDisableImageRestore),
			Usage: "(agent/images) Keep air-gap images pinned, but do not re-import one that was deleted from its archive"},
	}, policyFlags(envPrefix)...)
	return actions(flags, func(c *cli.Context) error {
		*s = Settings{
			DisableImagePinning: c.Bool(images.FlagDisableImagePinning),
			DisableImageRestore: c.Bool(images.FlagDisableImageRestore),
			PolicyValues:        policyValues(c),
		}
		_, err := s.Check()
		return err
	})
}

func policyFlags(envPrefix string) []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{Name: images.FlagPinnedImages, EnvVars: envVars(envPrefix, images.FlagPinnedImages),
			Usage: "(agent/images) Keep these images too, e.g. hand imports: repo:tag, repo@digest, bare repo (every tag), or glob (registry.local/*)"},
		&cli.StringSliceFlag{Name: images.FlagPinnedImageLabels, EnvVars: envVars(envPrefix, images.FlagPinnedImageLabels),
			Usage: "(agent/images) Keep images carrying these containerd labels: key or key=value"},
		&cli.BoolFlag{Name: images.FlagPinnedWorkloadImages, EnvVars: envVars(envPrefix, images.FlagPinnedWorkloadImages),
			Usage: "(agent/images) Keep every image a workload in --" + images.FlagWorkloadNamespaces + " references (Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs, CronJobs, Pods), scaled to zero or not; needs list and watch on them there"},
		&cli.StringSliceFlag{Name: images.FlagWorkloadNamespaces, EnvVars: envVars(envPrefix, images.FlagWorkloadNamespaces),
			Usage: "(agent/images) The namespaces whose workloads --" + images.FlagPinnedWorkloadImages + " keeps (required with it)"},
		&cli.StringFlag{Name: images.FlagWorkloadSelector, EnvVars: envVars(envPrefix, images.FlagWorkloadSelector),
			Usage: "(agent/images) Only the workloads whose labels match this selector count, e.g. k3s-pinning.io/keep=true"},
		&cli.IntFlag{Name: images.FlagMaxWorkloadImages, EnvVars: envVars(envPrefix, images.FlagMaxWorkloadImages), Value: images.DefaultMaxWorkloadImages,
			Usage: "(agent/images) Keep and fetch at most this many image references for workloads; each one refused is a WorkloadImageRefused Event"},
		&cli.StringFlag{Name: images.FlagMaxWorkloadImageBytes, EnvVars: envVars(envPrefix, images.FlagMaxWorkloadImageBytes),
			Usage: "(agent/images) Keep and fetch at most this many bytes of images for workloads, e.g. 20Gi (a fetch is stopped once its manifest tells its size)"},
		&cli.BoolFlag{Name: images.FlagFetchMissingImages, EnvVars: envVars(envPrefix, images.FlagFetchMissingImages),
			Usage: "(agent/images) Fetch a wanted image that is missing and that no archive here provides (--pinned-images by digest, retained, a workload's by digest) through the CRI, by digest: registries.yaml mirrors and the embedded registry's peers apply"},
		&cli.BoolFlag{Name: images.FlagRetainRemoved, EnvVars: envVars(envPrefix, images.FlagRetainRemoved),
			Usage: "(agent/images) Keep the images of an archive removed from the images dir pinned, as retained, until `k3s-pinning unpin`; a deleted one is fetched (--fetch-missing-images)"},
		&cli.IntFlag{Name: images.FlagFetchMaxDiskUsage, EnvVars: envVars(envPrefix, images.FlagFetchMaxDiskUsage), Value: images.DefaultFetchMaxDiskUsage,
			Usage: "(agent/images) Start no fetch, and pin no new workload image, while the image filesystem is used above this percent (the kubelet's image GC high threshold)"},
	}
}

// envVars is the variable k3s reads a flag from: K3S_PINNED_IMAGES for --pinned-images.
func envVars(envPrefix, flag string) []string {
	return []string{envPrefix + "_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))}
}

func policyValues(c *cli.Context) images.PolicyValues {
	return images.PolicyValues{PinnedImages: c.StringSlice(images.FlagPinnedImages), PinnedImageLabels: c.StringSlice(images.FlagPinnedImageLabels), PinnedWorkloadImages: c.Bool(images.FlagPinnedWorkloadImages),
		WorkloadNamespaces: c.StringSlice(images.FlagWorkloadNamespaces), WorkloadSelector: c.String(images.FlagWorkloadSelector), MaxWorkloadImages: c.Int(images.FlagMaxWorkloadImages),
		MaxWorkloadImageBytes: c.String(images.FlagMaxWorkloadImageBytes),
		FetchMissingImages:    c.Bool(images.FlagFetchMissingImages), RetainRemovedArchiveImages: c.Bool(images.FlagRetainRemoved), FetchMaxDiskUsage: c.Int(images.FlagFetchMaxDiskUsage)}
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
