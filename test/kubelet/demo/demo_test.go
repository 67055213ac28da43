package demo_test

import (
	"context"
	"io"
	"os"
	"testing"
	"time"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/test/kubelet/demo"
)

func run(t *testing.T, opts demo.Options) *demo.Result {
	t.Helper()
	containerdtest.RequireRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var log io.Writer = io.Discard
	if testing.Verbose() {
		log = os.Stderr
	}
	res, err := demo.Run(ctx, opts, log)
	if err != nil {
		t.Fatal(err)
	}
	if testing.Verbose() {
		res.Print(os.Stderr)
	}
	return res
}

// The control: without k3s-pinning, every GC path of the kubelet deletes the unused air-gap
// images. If this ever stops failing them, the other tests prove nothing.
func TestWithoutPinningTheKubeletDeletesAirgapImages(t *testing.T) {
	for _, path := range demo.GCPaths {
		t.Run(string(path), func(t *testing.T) {
			res := run(t, demo.Options{Protection: demo.None, Path: path})
			for _, row := range res.Rows {
				if !row.Before {
					t.Errorf("%s was never imported", row.Ref)
				}
				if row.After {
					t.Errorf("%s survived without pinning: the control does not reproduce the bug", row.Ref)
				}
			}
		})
	}
}

// On every GC path: with the agent's CRI pins and a stock kubelet, with the kubelet GC filter
// alone (every pin label stripped), and with both, every air-gap image is still in containerd
// after the cycle, and the unwanted image beside them was removed in the same cycle.
func TestAirgapImagesSurviveEveryGCPath(t *testing.T) {
	for _, protection := range []demo.Protection{demo.CRIPins, demo.FilterOnly, demo.PinsAndFilter} {
		for _, path := range demo.GCPaths {
			t.Run(string(protection)+"/"+string(path), func(t *testing.T) {
				res := run(t, demo.Options{Protection: protection, Path: path})
				wanted := 0
				for _, row := range res.Rows {
					switch {
					case !row.Before:
						t.Errorf("%s was never imported", row.Ref)
					case protection == demo.FilterOnly && row.Pinned:
						t.Errorf("%s still pinned after every pin label was stripped: the filter is not what kept it", row.Ref)
					case protection != demo.FilterOnly && row.Wanted && !row.Pinned:
						t.Errorf("air-gap image %s from %s not pinned", row.Ref, row.From)
					}
					if row.Wanted {
						wanted++
						if !row.After {
							t.Errorf("air-gap image %s from %s deleted by the kubelet GC", row.Ref, row.From)
						}
					} else if row.After {
						t.Errorf("unwanted %s survived: the GC did not run for real", row.Ref)
					}
				}
				if wanted != 5 {
					t.Errorf("%d air-gap images, want 5", wanted)
				}
			})
		}
	}
}
