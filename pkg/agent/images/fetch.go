package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/opencontainers/go-digest"
	"github.com/sirupsen/logrus"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Fetching (--fetch-missing-images): a wanted reference that is missing and that no archive of
// the images dir provides is pulled through the CRI by its digest, so that registries.yaml
// mirrors, credentials and k3s's embedded registry (spegel: the cluster's other nodes) apply, as
// for .txt lists. Never by a tag: a tag may point elsewhere by now. The pulled image is then
// pinned under every wanted name, each created pinned.
const (
	// fetchConcurrency bounds the pulls in flight: each takes disk and network a node also needs
	// for its pods.
	fetchConcurrency = 2
	// fetchTimeout bounds one pull: a peer that stops answering must not hold a slot for ever.
	fetchTimeout = 10 * time.Minute
)

// pendingFetch is one image to fetch: the repo@digest pulled, and the wanted references it
// brings back.
type pendingFetch struct {
	pull     string
	digest   digest.Digest
	refs     map[string]bool
	retryAt  time.Time
	backoff  time.Duration
	noSpace  bool // the last attempt was not started: the image filesystem is above the threshold
	inFlight bool
}

// fetchResult is what one pull ended with.
type fetchResult struct {
	pull   string
	target images.Image // the pulled repo@digest record
	err    error
	took   time.Duration
}

// fetchFrom says where a missing ref comes back from when no archive provides it: "a fetch" when
// one is on and a digest is known for it, else "" (lost).
func (a *Agent) fetchFrom(ref string) string {
	if _, ok := a.plan.Fetchable(ref); ok && a.cfg.Fetch && a.cd.CRI != nil {
		return "a fetch"
	}
	return ""
}

// scheduleFetches adds every missing reference that can be fetched to pending, and drops those
// that nothing wants any more (dropFetches).
func (a *Agent) scheduleFetches(pending map[string]*pendingFetch) {
	if !a.cfg.Fetch || a.cd.CRI == nil || pending == nil {
		return
	}
	a.dropFetches(pending)
	for _, ref := range slices.Sorted(maps.Keys(a.track.missing)) {
		d, ok := a.plan.Fetchable(ref)
		if !ok {
			continue
		}
		pull := a.digestRefs.Of(ref, d)
		if pull == "" {
			continue
		}
		p := pending[pull]
		if p == nil {
			p = &pendingFetch{pull: pull, digest: d, refs: map[string]bool{}, backoff: retryMin, retryAt: time.Now()}
			pending[pull] = p
		}
		p.refs[ref] = true
	}
}

// dropFetches forgets the references of pending that are no longer both missing and fetchable
// (their workload is gone, the policy changed, they came back another way), with their errors: no
// pull starts for nothing. A pull in flight for none ends unheeded (fetched).
func (a *Agent) dropFetches(pending map[string]*pendingFetch) {
	dropped := false
	for pull, p := range pending {
		for ref := range p.refs {
			if _, ok := a.plan.Fetchable(ref); !ok || !a.track.missing[ref] {
				delete(p.refs, ref)
				delete(a.state.Agent.FetchErrors, ref)
				dropped = true
				logrus.Infof("fetch of %s dropped: nothing wants it fetched any more", ref)
			}
		}
		if len(p.refs) == 0 && !p.inFlight {
			delete(pending, pull)
		}
	}
	if dropped {
		a.saveViewChange()
	}
}

// startFetches starts the pulls that are due, up to fetchConcurrency in flight, each reporting to
// results; it returns how long until the next one is due (0: none waiting). No pull starts while
// the image filesystem is used above the threshold.
func (a *Agent) startFetches(ctx context.Context, pending map[string]*pendingFetch, results chan<- fetchResult, running func(func())) time.Duration {
	inFlight := 0
	for _, p := range pending {
		if p.inFlight {
			inFlight++
		}
	}
	now := time.Now()
	var next time.Duration
	for _, pull := range slices.Sorted(maps.Keys(pending)) {
		p := pending[pull]
		if p.inFlight {
			continue
		}
		if wait := p.retryAt.Sub(now); wait > 0 || inFlight >= fetchConcurrency {
			if wait <= 0 {
				wait = retryMin // a slot frees up when a pull ends; look again then at the latest
			}
			if next == 0 || wait < next {
				next = wait
			}
			continue
		}
		if full, err := a.fetchRoom(ctx); err != nil {
			a.fetchFailed(p, err, full)
			if next == 0 || p.backoff < next {
				next = p.backoff
			}
			continue
		}
		p.inFlight, p.noSpace = true, false
		inFlight++
		guard := a.guardOf(p)
		running(func() {
			start := time.Now()
			pctx, cancel := context.WithTimeout(ctx, fetchTimeout)
			defer cancel()
			res := fetchResult{pull: p.pull}
			res.err = a.guardedPull(pctx, guard, func(ctx context.Context) error {
				_, err := a.cd.CRI.PullImage(ctx, &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: p.pull}})
				return err
			})
			if res.err == nil {
				res.target, res.err = a.cd.Images.Get(ctx, p.pull)
			}
			if res.err == nil && res.target.Target.Digest != p.digest {
				res.err = fmt.Errorf("pulled %s, want %s", res.target.Target.Digest, p.digest)
			}
			res.took = time.Since(start)
			results <- res
		})
	}
	return next
}

// fetchRoom is nil when the image filesystem has room for a fetch (imagefsAbove); full says the
// threshold is what holds the fetch back.
func (a *Agent) fetchRoom(ctx context.Context) (full bool, err error) {
	above, why, err := a.imagefsAbove(ctx, 0)
	switch {
	case err != nil:
		return false, fmt.Errorf("image filesystem usage unknown, not fetching: %w", err)
	case above:
		return true, errors.New(why + ": not fetching until it is below")
	}
	return false, nil
}

// fetchFailed records a failed or held-back fetch (noSpace: held back by the disk threshold): an
// Event naming the image and the reason, and a retry with backoff. The state file is written only
// when what status and doctor show of it changed: a fetch failing again the same way writes
// nothing.
func (a *Agent) fetchFailed(p *pendingFetch, err error, noSpace bool) {
	var refused *pullRefused
	errors.As(err, &refused)
	p.noSpace = noSpace || isNoSpace(err) || (refused != nil && refused.noSpace)
	p.retryAt = time.Now().Add(jittered(p.backoff))
	a.state.Agent.FetchesFailed++
	if a.state.Agent.FetchErrors == nil {
		a.state.Agent.FetchErrors = map[string]string{}
	}
	refs := firstFew(slices.Sorted(maps.Keys(p.refs)))
	for ref := range p.refs {
		a.state.Agent.FetchErrors[ref] = err.Error()
	}
	if refused != nil && refused.owners != "" {
		logrus.Warnf("%s, named by %s, not fetched: %v; asking again in %s", refs, refused.owners, err, p.backoff)
		a.event(true, ReasonWorkloadImageRefused, "%s, named by %s, not fetched by digest %s: %v", refs, refused.owners, p.digest, err)
	} else {
		logrus.Errorf("fetch %s (%s) failed, retrying in %s: %v", p.pull, refs, p.backoff, err)
		a.event(true, ReasonImageFetchFailed, "fetching %s by digest %s failed, retrying in %s: %v", refs, p.digest, p.backoff, err)
	}
	p.backoff = min(2*p.backoff, retryMax)
	a.saveViewChange()
}

// fetched pins what a pull brought back under every wanted name, each created pinned, or records
// its failure.
func (a *Agent) fetched(ctx context.Context, res fetchResult, pending map[string]*pendingFetch) {
	p := pending[res.pull]
	if p == nil {
		return
	}
	p.inFlight = false
	if len(p.refs) == 0 { // dropped while in flight: the image is left unpinned, for the kubelet
		delete(pending, res.pull)
		return
	}
	if res.err != nil {
		a.fetchFailed(p, res.err, false)
		return
	}
	var errs []error
	for _, ref := range slices.Sorted(maps.Keys(p.refs)) {
		source, wanted := a.plan.Source(images.Image{Name: ref, Target: res.target.Target})
		if !wanted {
			continue // no longer wanted since it was scheduled: the image is left unpinned
		}
		var err error
		if ref == res.pull {
			_, err = a.pinner.Pin(ctx, ref, source)
		} else {
			_, err = a.pinner.Put(ctx, images.Image{Name: ref, Target: res.target.Target}, source)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		a.trackCreated(ref)
		delete(a.state.Agent.FetchErrors, ref)
	}
	if err := errors.Join(errs...); err != nil {
		a.fetchFailed(p, err, false)
		return
	}
	delete(pending, res.pull)
	a.state.Agent.FetchesDone++
	took := res.took.Round(time.Millisecond)
	refs := firstFew(slices.Sorted(maps.Keys(p.refs)))
	logrus.Infof("fetched %s by digest %s in %s, pinned", refs, p.digest, took)
	a.event(false, ReasonImageFetched, "fetched %s by digest %s in %s through the CRI, pinned", refs, p.digest, took)
	a.saveState()
	a.requestSync() // the kubelet's keep-set learns the new image's ID
}
