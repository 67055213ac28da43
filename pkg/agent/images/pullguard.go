package images

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/containerd/errdefs"
	"github.com/docker/go-units"
	"github.com/opencontainers/go-digest"
	"github.com/sirupsen/logrus"
)

// A fetch's size: a pull through the CRI says nothing of the image's size before it ends, but
// containerd's content store holds the image's manifests before its layers (it reads them to
// know the layers). A guard watches for them while the pull runs, and stops the pull when the
// image would bring the image filesystem above the threshold, or a workload's image beyond what
// --max-workload-image-bytes leaves: most of its bytes are then not downloaded yet.

// sizeCheckInterval is how often a guard looks for the pulled image's manifests.
const sizeCheckInterval = 100 * time.Millisecond

// pullGuard is what one pull may take.
type pullGuard struct {
	digest digest.Digest
	// budget is what --max-workload-image-bytes leaves for an image wanted for workloads alone;
	// budgeted false: no such bound. owners are the workloads naming it, for the refusal.
	budget   int64
	budgeted bool
	owners   string
}

// pullRefused is a pull a guard stopped: the image is too large for the room left.
type pullRefused struct {
	msg     string
	noSpace bool   // the image filesystem's threshold, not a workload limit
	owners  string // the workloads it was fetched for, when their limit refused it
}

func (e *pullRefused) Error() string { return e.msg }

// guardOf is the guard of a fetch of p: its refs are wanted for workloads alone when no archive
// or policy wants any of them.
func (a *Agent) guardOf(p *pendingFetch) pullGuard {
	g := pullGuard{digest: p.digest}
	if a.cfg.MaxWorkloadImageBytes <= 0 {
		return g
	}
	var owners []string
	for ref := range p.refs {
		if !a.workloads[ref] || a.plan.WantedBesidesWorkloads(ref) {
			return g
		}
		owners = append(owners, a.workloadImages[ref]...)
	}
	g.budget, g.budgeted = a.cfg.MaxWorkloadImageBytes-a.workloadBytes, true
	g.owners = firstFew(slices.Compact(slices.Sorted(slices.Values(owners))))
	return g
}

// watch checks the pull of g's image once its size is known, and returns why it must stop, or
// nil: fits, the size cannot be read, or ctx ended first. It reads no agent state under the lock.
func (a *Agent) watch(ctx context.Context, g pullGuard) error {
	tick := time.NewTicker(sizeCheckInterval)
	defer tick.Stop()
	for {
		size, err := imageSize(ctx, a.cd.Content, g.digest)
		switch {
		case err == nil:
			return a.fits(ctx, g, size)
		case !errdefs.IsNotFound(err):
			if ctx.Err() == nil {
				logrus.Warnf("fetch %s: its size cannot be read (%v): the threshold was checked at its start only", g.digest, err)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// fits is nil when an image of size bytes fits g and the image filesystem's threshold.
func (a *Agent) fits(ctx context.Context, g pullGuard, size int64) error {
	if err := a.withinBudget(g, size); err != nil {
		return err
	}
	above, why, err := a.imagefsAbove(ctx, size)
	if err != nil || !above {
		return nil // unknown usage: the check at the start stands
	}
	return &pullRefused{noSpace: true, msg: why}
}

// withinBudget is nil when an image of size bytes fits what --max-workload-image-bytes leaves g.
func (a *Agent) withinBudget(g pullGuard, size int64) error {
	if !g.budgeted || size <= g.budget {
		return nil
	}
	return &pullRefused{owners: g.owners, msg: fmt.Sprintf("the image's %s is more than the %s --%s %s leaves",
		units.BytesSize(float64(size)), units.BytesSize(float64(max(g.budget, 0))), FlagMaxWorkloadImageBytes, units.BytesSize(float64(a.cfg.MaxWorkloadImageBytes)))}
}

// guardedPull runs pull under g: it returns pull's error, or the guard's when the guard stopped
// it.
func (a *Agent) guardedPull(ctx context.Context, g pullGuard, pull func(context.Context) error) error {
	pullCtx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		if err := a.watch(pullCtx, g); err != nil {
			stop(err)
		}
	}()
	err := pull(pullCtx)
	var refused *pullRefused
	if cause := context.Cause(pullCtx); errors.As(cause, &refused) {
		err = refused
	}
	stop(nil)
	<-watched
	if err == nil && g.budgeted {
		// A pull faster than the guard's look: the budget still holds (the image is then left
		// unpinned, for the kubelet); the disk's threshold is past asking.
		if size, serr := imageSize(ctx, a.cd.Content, g.digest); serr == nil {
			err = a.withinBudget(g, size)
		}
	}
	return err
}
