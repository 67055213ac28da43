package images

import (
	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// PolicyOptions holds the values of the policy flags.
type PolicyOptions struct {
	PinnedImages      cli.StringSlice
	PinnedImageLabels cli.StringSlice
}

// PolicyFlags are the policy flags, written for urfave/cli/v2 as k3s writes its own, so that the
// same definitions can be appended to the `k3s agent` and `k3s server` commands. Each returns new
// flag values: urfave flags keep per-parse state and must not be shared between commands.
func PolicyFlags(o *PolicyOptions) []cli.Flag {
	return []cli.Flag{
		&cli.StringSliceFlag{
			Name:        "pinned-images",
			Usage:       "(agent/images) Keep these images too, e.g. hand imports: repo:tag, repo@digest, bare repo (every tag), or glob (registry.local/*)",
			EnvVars:     []string{"K3S_PINNED_IMAGES"},
			Destination: &o.PinnedImages,
		},
		&cli.StringSliceFlag{
			Name:        "pinned-image-labels",
			Usage:       "(agent/images) Keep images carrying these containerd labels: key or key=value",
			EnvVars:     []string{"K3S_PINNED_IMAGE_LABELS"},
			Destination: &o.PinnedImageLabels,
		},
	}
}

// Policy parses the flag values; a malformed pattern is an error naming the flag and the value.
func (o *PolicyOptions) Policy() (*pinning.Policy, error) {
	return pinning.NewPolicy(o.PinnedImages.Value(), o.PinnedImageLabels.Value())
}
