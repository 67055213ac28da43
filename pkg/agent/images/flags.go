package images

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// PolicyOptions holds the values of the policy flags.
type PolicyOptions struct {
	PinnedImages      cli.StringSlice
	PinnedImageLabels cli.StringSlice
}

// PolicyFlags are the policy flags, written for urfave/cli/v2 as k3s writes its own, so that the
// same definitions can be appended to the `k3s agent` and `k3s server` commands. Each call returns
// new flag values: urfave flags keep per-parse state and must not be shared between commands.
// envPrefix is k3s's version.ProgramUpper ("K3S", or "RKE2" in rke2).
func PolicyFlags(o *PolicyOptions, envPrefix string) []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{
			Name:        "pinned-images",
			Usage:       "(agent/images) Keep these images too, e.g. hand imports: repo:tag, repo@digest, bare repo (every tag), or glob (registry.local/*)",
			EnvVars:     []string{envPrefix + "_PINNED_IMAGES"},
			Destination: &o.PinnedImages,
		},
		&cli.StringSliceFlag{
			Name:        "pinned-image-labels",
			Usage:       "(agent/images) Keep images carrying these containerd labels: key or key=value",
			EnvVars:     []string{envPrefix + "_PINNED_IMAGE_LABELS"},
			Destination: &o.PinnedImageLabels,
		},
	}
}

// Policy parses the flag values; a malformed pattern is an error naming the flag and the value.
func (o *PolicyOptions) Policy() (*pinning.Policy, error) {
	return pinning.NewPolicy(o.PinnedImages.Value(), o.PinnedImageLabels.Value())
}

// K3sOptions are the values of the flags a patched k3s adds to `k3s agent` and `k3s server`
// (both run an agent). Every one is also a K3S_ environment variable and a key of
// /etc/rancher/k3s/config.yaml, as every k3s flag is.
type K3sOptions struct {
	// DisableImagePinning leaves the images dir to k3s's own import: no pins set at creation, no
	// restore, no kubelet GC filter.
	DisableImagePinning bool
	// DisableImageRestore keeps pinning but does not re-import a deleted image from its archive.
	DisableImageRestore bool
	Policy              PolicyOptions
}

// K3sFlags are the k3s-pinning flags of one k3s command; call it once per command, with the same
// options. envPrefix is k3s's version.ProgramUpper. Each flag that is set (on the command line, as
// a K3S_ variable or a config.yaml key) checks all the values once they are parsed, so that a bad
// one stops k3s before it starts anything, with an error naming the flag (k3s exits 1 on a parse
// error; the agent's check when it loads agent/images can only request a shutdown).
func K3sFlags(o *K3sOptions, envPrefix string) []cli.Flag {
	flags := k3sFlags(o, envPrefix)
	validate := func(*cli.Context) error {
		_, err := o.Validate()
		return err
	}
	for _, f := range flags {
		switch f := f.(type) {
		case *cli.BoolFlag:
			f.Action = func(c *cli.Context, _ bool) error { return validate(c) }
		case *cli.StringSliceFlag:
			f.Action = func(c *cli.Context, _ []string) error { return validate(c) }
		}
	}
	return flags
}

func k3sFlags(o *K3sOptions, envPrefix string) []cli.Flag {
	return append([]cli.Flag{
		&cli.BoolFlag{
			Name:        "disable-image-pinning",
			Usage:       "(agent/images) Import agent/images as k3s does without k3s-pinning: no pin at creation, no restore, no kubelet image GC filter",
			EnvVars:     []string{envPrefix + "_DISABLE_IMAGE_PINNING"},
			Destination: &o.DisableImagePinning,
		},
		&cli.BoolFlag{
			Name:        "disable-image-restore",
			Usage:       "(agent/images) Keep air-gap images pinned, but do not re-import one that was deleted from its archive",
			EnvVars:     []string{envPrefix + "_DISABLE_IMAGE_RESTORE"},
			Destination: &o.DisableImageRestore,
		},
	}, PolicyFlags(&o.Policy, envPrefix)...)
}

// Enabled reports whether k3s-pinning takes over the images dir.
func (o *K3sOptions) Enabled() bool { return !o.DisableImagePinning }

// Validate checks the values once parsed, naming the flag of a bad one, and returns the policy
// they describe.
func (o *K3sOptions) Validate() (*pinning.Policy, error) {
	if o.DisableImagePinning && (len(o.Policy.PinnedImages.Value()) > 0 || len(o.Policy.PinnedImageLabels.Value()) > 0) {
		return nil, fmt.Errorf("--pinned-images and --pinned-image-labels need image pinning; remove them or --disable-image-pinning")
	}
	return o.Policy.Policy()
}
