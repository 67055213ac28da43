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

// The control: without k3s-pinning, the kubelet's real GC deletes the unused air-gap images.
// If this ever stops failing them, the other tests prove nothing.
func TestWithoutPinningTheKubeletDeletesAirgapImages(t *testing.T) {
	for _, path := range []demo.GCPath{demo.Threshold, demo.Eviction} {
		res := run(t, demo.Options{Agent: false, Path: path})
		for _, row := range res.Rows {
			if !row.Before {
				t.Errorf("%s: %s was never imported", path, row.Ref)
			}
			if row.After {
				t.Errorf("%s: %s survived without pinning: the control does not reproduce the bug", path, row.Ref)
			}
		}
	}
}

func TestAgentKeepsAirgapImagesThroughRealGC(t *testing.T) {
	for _, path := range []demo.GCPath{demo.Threshold, demo.Eviction} {
		res := run(t, demo.Options{Agent: true, Path: path})
		wanted := 0
		for _, row := range res.Rows {
			switch {
			case row.Wanted:
				wanted++
				if !row.Pinned || !row.After {
					t.Errorf("%s: air-gap image %s from %s: pinned=%t after=%t", path, row.Ref, row.From, row.Pinned, row.After)
				}
			case row.After:
				t.Errorf("%s: unwanted %s survived: the GC did not run for real", path, row.Ref)
			}
		}
		if wanted != 5 || len(res.Removed) == 0 {
			t.Errorf("%s: %d air-gap images, %d removals logged by the kubelet GC", path, wanted, len(res.Removed))
		}
	}
}
