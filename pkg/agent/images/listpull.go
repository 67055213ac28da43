package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/distribution/reference"
	"github.com/sirupsen/logrus"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
)

// The entries of .txt lists are pulled through the CRI from a registry, which may never answer.
// While Run runs, a sync does not pull them under the agent's lock: it hands each missing entry
// to listPulls, which pulls it in the background with a deadline, and the sync after the pull
// pins it. Restores and re-pins go on meanwhile. A sync without Run (the `sync` command, k3s's
// start-up) pulls in place, each entry within listPullTimeout.
const (
	// listPullTimeout bounds a pull made in place, under the agent's lock.
	listPullTimeout = time.Minute
	// listPullConcurrency bounds the background pulls in flight.
	listPullConcurrency = 2
)

// listPulls are the background pulls of list entries; safe for the concurrent loads of one sync.
type listPulls struct {
	mu      sync.Mutex
	pulls   map[string]*listPull // by reference
	asked   map[string]bool      // references a sync asked for since beginSync
	timeout time.Duration
}

// listPull is one list entry to pull.
type listPull struct {
	retryAt  time.Time
	backoff  time.Duration
	inFlight bool
	err      error // the last attempt's, until the next attempt
}

// listPullResult is what one background pull ended with.
type listPullResult struct {
	ref string
	err error
}

func newListPulls(timeout time.Duration) *listPulls {
	return &listPulls{pulls: map[string]*listPull{}, timeout: timeout}
}

// later schedules a pull of ref; it returns the last attempt's error, or nil while one is due or
// under way.
func (l *listPulls) later(ref string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.asked != nil {
		l.asked[ref] = true
	}
	p := l.pulls[ref]
	if p == nil {
		l.pulls[ref] = &listPull{retryAt: time.Now(), backoff: retryMin}
		return nil
	}
	return p.err
}

// beginSync starts counting what a sync asks for; endSync drops the pulls it did not ask for
// (the list changed, the image came back another way), except those in flight, which end
// unheeded.
func (l *listPulls) beginSync() {
	l.mu.Lock()
	l.asked = map[string]bool{}
	l.mu.Unlock()
}

func (l *listPulls) endSync() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for ref, p := range l.pulls {
		if !l.asked[ref] && !p.inFlight {
			delete(l.pulls, ref)
		}
	}
	l.asked = nil
}

// start starts the pulls that are due, each with the deadline, and returns how long until the
// next is due (0: none waiting).
func (l *listPulls) start(ctx context.Context, cri runtimeapi.ImageServiceClient, results chan<- listPullResult, running func(func())) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	inFlight := 0
	for _, p := range l.pulls {
		if p.inFlight {
			inFlight++
		}
	}
	var next time.Duration
	for _, ref := range slices.Sorted(maps.Keys(l.pulls)) {
		p := l.pulls[ref]
		if p.inFlight {
			continue
		}
		if wait := time.Until(p.retryAt); wait > 0 || inFlight >= listPullConcurrency {
			if wait <= 0 {
				wait = retryMin
			}
			if next == 0 || wait < next {
				next = wait
			}
			continue
		}
		p.inFlight = true
		inFlight++
		running(func() {
			pctx, cancel := context.WithTimeout(ctx, l.timeout)
			defer cancel()
			_, err := cri.PullImage(pctx, &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
			if err != nil && pctx.Err() != nil && ctx.Err() == nil {
				err = fmt.Errorf("no answer within %s: %w", l.timeout, err)
			}
			results <- listPullResult{ref: ref, err: err}
		})
	}
	return next
}

// done records a pull's end: a failure is retried after a jittered backoff. It reports whether a
// sync should follow: to pin what came, or to report a failure not reported yet (a pull failing
// again the same way syncs nothing).
func (l *listPulls) done(res listPullResult) (sync bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.pulls[res.ref]
	if p == nil {
		return false
	}
	p.inFlight = false
	if res.err == nil {
		delete(l.pulls, res.ref)
		logrus.Infof("pulled %s (a list's entry) in the background", res.ref)
		return true
	}
	sync = p.err == nil || p.err.Error() != res.err.Error()
	p.err = res.err
	p.retryAt = time.Now().Add(jittered(p.backoff))
	logrus.Errorf("pull %s (a list's entry) failed, retrying in %s: %v", res.ref, p.backoff, res.err)
	p.backoff = min(2*p.backoff, retryMax)
	return sync
}

// criStatus is the CRI's status of ref. The CRI learns of images from containerd's events, so an
// image a tarball created a moment ago may not be in its view yet: when containerd has ref, the
// CRI is given a moment to catch up rather than asked to pull it (an air-gapped pull fails).
func (im *importer) criStatus(ctx context.Context, ref string) (*runtimeapi.ImageStatusResponse, error) {
	_, inStore := im.cd.Images.Get(ctx, ref)
	deadline := time.Now().Add(2 * time.Second)
	for {
		status, err := im.cd.CRI.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
		if err != nil || status.GetImage() != nil || inStore != nil || time.Now().After(deadline) {
			return status, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// pullList pulls through the CRI (so registry mirrors and credentials apply) each reference of a
// .txt list that is not present, then pins it and the repo@digest reference the CRI created.
func (im *importer) pullList(ctx context.Context, idx *airgap.Index) ([]RefResult, bool, error) {
	if im.cd.CRI == nil {
		return nil, false, &airgap.ArchiveError{Path: idx.Archive.Path, Err: errors.New("no CRI image service to pull the list's entries through")}
	}
	var (
		refs   []RefResult
		pulled bool
		errs   []error
		source = idx.Archive.Name()
	)
	for _, want := range idx.Images {
		status, err := im.criStatus(ctx, want.Ref)
		if err == nil && status.GetImage() == nil && im.pullLater != nil {
			if err = im.pullLater(want.Ref); err == nil {
				refs = append(refs, RefResult{Ref: want.Ref, Err: errPullPending})
				continue
			}
		} else if err == nil && status.GetImage() == nil {
			pctx, cancel := context.WithTimeout(ctx, listPullTimeout)
			if _, err = im.cd.CRI.PullImage(pctx, &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: want.Ref}}); err == nil {
				pulled = true
				status, err = im.cd.CRI.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: want.Ref}})
			} else if pctx.Err() != nil && ctx.Err() == nil {
				err = fmt.Errorf("no answer within %s: %w", listPullTimeout, err)
			}
			cancel()
		}
		if err == nil && status.GetImage() == nil {
			err = errors.New("not present after pull")
		}
		if err != nil {
			err = &airgap.ArchiveError{Path: idx.Archive.Path, Line: want.Line, Err: fmt.Errorf("pull %s: %w", want.Ref, err)}
			refs = append(refs, RefResult{Ref: want.Ref, Err: err})
			errs = append(errs, err)
			continue
		}
		names := []string{want.Ref}
		repo := want.Ref
		if named, err := reference.ParseNormalizedNamed(want.Ref); err == nil {
			repo = named.Name()
		}
		for _, rd := range status.GetImage().GetRepoDigests() {
			if named, err := reference.ParseNormalizedNamed(rd); err == nil && named.Name() == repo && rd != want.Ref {
				names = append(names, rd)
			}
		}
		for _, name := range names {
			r := RefResult{Ref: name}
			img, err := im.cd.Images.Get(ctx, name)
			if err == nil {
				r.Digest = img.Target.Digest.String()
				r.Result, err = im.pinner.PinImage(ctx, img, source)
			}
			if err != nil {
				r.Err = &airgap.ArchiveError{Path: idx.Archive.Path, Line: want.Line, Err: err}
				errs = append(errs, r.Err)
			}
			refs = append(refs, r)
		}
	}
	return refs, pulled, errors.Join(errs...)
}

// normalize is ref as containerd names it (nginx:1 is docker.io/library/nginx:1), or ref.
func normalize(ref string) string {
	named, err := reference.ParseDockerRef(ref)
	if err != nil {
		return ref
	}
	return named.String()
}
