package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/typeurl/v2"
	"github.com/fsnotify/fsnotify"
	"github.com/sirupsen/logrus"
	"golang.org/x/sync/errgroup"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// RunOptions tune the long-running agent.
type RunOptions struct {
	// ReconcileInterval is the period of the full reconcile that backs up the events.
	ReconcileInterval time.Duration
	// Restore re-imports a wanted image that was deleted, from its archive.
	Restore bool
	// Synced says the caller ran Sync just before (k3s's start-up, which waits for the import):
	// Run does not sync again before it follows events.
	Synced bool
	// AfterSync, when set, is called after each full sync, outside the agent's lock. The
	// standalone daemon returns the sync's transient memory to the system there (a sync lists
	// every image and content entry of the store).
	AfterSync func()
}

// DefaultReconcileInterval is the safety-net period; events do the steady-state work.
const DefaultReconcileInterval = 5 * time.Minute

// StalledIntervals is how many reconcile intervals may pass without a reconcile ending before the
// agent counts as stuck (its /healthz, its node condition): one reconcile may be slow (a first
// sync of a large images dir), three in a row are not.
const StalledIntervals = 3

const (
	// fsSettle lets a copy into the images dir finish before the archive is read.
	fsSettle = time.Second
	// restoreGather collects the burst of delete events one RemoveImage makes (every reference of
	// the image) into one restore per archive.
	restoreGather = 100 * time.Millisecond
	// reconnectMax caps the wait between attempts to reach containerd again, so that protection
	// resumes within a few seconds of it coming back.
	reconnectMax = 2 * time.Second
	retryMin     = time.Second
	retryMax     = time.Minute
)

// jittered is d plus up to half of d at random: the nodes of a fleet that failed together (a peer
// gone, a registry down) do not all try again at the same moment.
func jittered(d time.Duration) time.Duration { return d + rand.N(d/2+1) }

// pendingRestore is an archive with references to bring back.
type pendingRestore struct {
	refs    map[string]bool
	retryAt time.Time
	backoff time.Duration
	noSpace bool // the last attempt failed on a full disk
}

// Run syncs, then keeps the node in the wanted state until ctx ends: it re-pins a wanted reference
// whose pin is removed, restores a wanted reference that is deleted, follows archives added,
// replaced and removed, and reconciles in full every ReconcileInterval and whenever containerd
// comes back. The namespace is the one in ctx. Run owns the goroutines it starts: when it
// returns, they have ended and the state is saved.
func (a *Agent) Run(ctx context.Context, opts RunOptions) error {
	if opts.ReconcileInterval <= 0 {
		opts.ReconcileInterval = DefaultReconcileInterval
	}
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return err
	}
	defer a.releaseAgentLock()
	events := make(chan any, 256)
	g, ctx := errgroup.WithContext(ctx)
	if a.cd.Events != nil {
		g.Go(func() error { a.watchEvents(ctx, ns, events, a.requestSync); return nil })
	}
	g.Go(func() error { a.watchDir(ctx, a.requestSync); return nil })
	g.Go(func() error { return a.follow(ctx, opts, events, a.resync) })
	return g.Wait()
}

// follow is Run's loop: each event, sync and restore is handled whole, in turn with the exported
// methods.
func (a *Agent) follow(ctx context.Context, opts RunOptions, events <-chan any, resync <-chan struct{}) error {
	a.mu.Lock()
	a.pulls = newListPulls(fetchTimeout)
	a.importer.pullLater = a.pulls.later
	if !opts.Synced {
		a.sync(ctx)
	}
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.pulls, a.importer.pullLater = nil, nil
		a.mu.Unlock()
	}()
	afterSync := func() {
		if opts.AfterSync != nil {
			opts.AfterSync()
		}
	}
	if !opts.Synced {
		afterSync()
	}
	pending := map[string]*pendingRestore{}
	fetches := map[string]*pendingFetch{}
	listPulled := make(chan listPullResult, listPullConcurrency) // never more in flight: sends never block
	a.mu.Lock()
	a.toRestore, a.toFetch = pending, fetches
	a.mu.Unlock()
	results := make(chan fetchResult, fetchConcurrency) // never more pulls in flight: sends never block
	var pulls sync.WaitGroup
	running := func(f func()) {
		pulls.Add(1)
		go func() { defer pulls.Done(); f() }()
	}
	defer pulls.Wait() // ctx has ended: the pulls end with it
	a.mu.Lock()
	a.scheduleFetches(fetches) // what the start-up sync found missing
	a.mu.Unlock()
	ticker := time.NewTicker(opts.ReconcileInterval)
	defer ticker.Stop()
	restoreTimer := time.NewTimer(time.Hour)
	restoreTimer.Stop()
	fetchTimer := time.NewTimer(0)
	listPullTimer := time.NewTimer(0)
	for {
		var ev any
		var res *fetchResult
		tick, restoreDue := false, false
		select {
		case r := <-listPulled:
			tick = a.pulls.done(r) // the sync pins what came, or reports the new failure
		case <-listPullTimer.C:
		case <-ctx.Done():
			a.mu.Lock()
			a.saveState()
			a.mu.Unlock()
			return nil
		case r := <-results:
			res = &r
		case <-fetchTimer.C:
		case <-ticker.C:
			tick = true
		case <-resync:
			tick = true
		case ev = <-events:
		case <-restoreTimer.C:
			restoreDue = true
		}
		a.mu.Lock()
		switch e := ev.(type) {
		case *eventstypes.ImageCreate:
			a.trackCreated(e.Name)
			a.repin(ctx, e.Name, e.Labels)
		case *eventstypes.ImageUpdate:
			a.trackCreated(e.Name)
			a.repin(ctx, e.Name, e.Labels)
		case *eventstypes.ImageDelete:
			src := a.plan.Archive(e.Name)
			from := src
			if from == "" {
				from = a.fetchFrom(e.Name)
			}
			if a.keeper.Wanted(e.Name) || from != "" {
				a.trackDeleted(e.Name, from)
				a.scheduleFetches(fetches)
			}
			if opts.Restore && src != "" {
				p := pending[src]
				if p == nil {
					p = &pendingRestore{refs: map[string]bool{}, backoff: retryMin}
					pending[src] = p
				}
				p.refs[e.Name] = true
				p.retryAt = time.Now().Add(restoreGather)
				restoreTimer.Reset(restoreGather)
			}
		}
		if res != nil {
			a.fetched(ctx, *res, fetches)
		}
		if tick {
			a.sync(ctx)
			a.scheduleFetches(fetches)
		}
		if restoreDue {
			if next := a.restore(ctx, pending); next > 0 {
				restoreTimer.Reset(next)
			}
		}
		if next := a.startFetches(ctx, fetches, results, running); next > 0 {
			fetchTimer.Reset(next)
		}
		if a.cd.CRI != nil {
			if next := a.pulls.start(ctx, a.cd.CRI, listPulled, running); next > 0 {
				listPullTimer.Reset(next)
			}
		}
		a.updateView()
		a.reportProtection()
		a.mu.Unlock()
		if tick {
			afterSync()
		}
	}
}

// repin pins again a wanted reference whose pin is gone (stripped by hand, or by k3s clearing its
// labels at start), and pins a new image the policy wants.
func (a *Agent) repin(ctx context.Context, name string, labels map[string]string) {
	if pinning.IsPinned(labels) || imagelist.IsImageID(name) {
		return
	}
	source, wanted := a.plan.Source(images.Image{Name: name, Labels: labels})
	if wanted && a.plan.Retained(source) {
		// Unpinned: maybe by `k3s-pinning unpin`, which lets a retained image go. Ask the state
		// file, where it said so, before pinning it again.
		a.reloadRetained()
		a.replan()
		source, wanted = a.plan.Source(images.Image{Name: name, Labels: labels})
	}
	if !wanted {
		return
	}
	res, err := a.pinner.Pin(ctx, name, source)
	switch {
	case err != nil:
		logrus.Errorf("re-pin %s: %v", name, err)
	case res == pinning.Pinned:
		a.metrics.repins.Inc()
		logrus.Infof("pinned %s again (%s wants it)", name, source)
	}
}

// restore re-loads every archive whose deadline has come and returns how long until the next
// retry (0: nothing left). A failed restore is retried with backoff; a full disk is reported as
// such, and nothing spins.
func (a *Agent) restore(ctx context.Context, pending map[string]*pendingRestore) time.Duration {
	now := time.Now()
	var next time.Duration
	for _, name := range slices.Sorted(maps.Keys(pending)) {
		p := pending[name]
		if wait := p.retryAt.Sub(now); wait > 0 {
			if next == 0 || wait < next {
				next = wait
			}
			continue
		}
		rec := a.state.Archives[name]
		ar, err := airgap.At(filepath.Join(a.cfg.ImagesDir, name))
		if rec == nil || err != nil {
			// The archive left the images dir since the plan was made (removed just before the
			// image was deleted: the dir's change is followed a second later). Nothing to restore
			// from; the plan made again says whether the references are still wanted (retained:
			// fetched) before anything is called lost.
			delete(pending, name)
			a.sync(ctx)
			for _, ref := range slices.Sorted(maps.Keys(p.refs)) {
				if a.track.missing[ref] { // wanted, and still absent from the sync's list
					a.trackDeleted(ref, a.fetchFrom(ref))
				}
			}
			a.scheduleFetches(a.toFetch)
			continue
		}
		recorded := rec.Refs
		start := time.Now()
		rep := a.syncArchive(ctx, ar)
		if err := restoreError(rep, p.refs); err != nil {
			a.metrics.restores.WithLabelValues("failed").Inc()
			a.state.Agent.RestoresFailed++
			p.retryAt, p.noSpace = time.Now().Add(jittered(p.backoff)), isNoSpace(err)
			logrus.Errorf("restore from %s failed, retrying in %s: %v", name, p.backoff, err)
			a.event(true, ReasonImageRestoreFailed, "restoring %s from %s failed, retrying in %s: %v", firstFew(slices.Sorted(maps.Keys(p.refs))), name, p.backoff, err)
			p.backoff = min(2*p.backoff, retryMax)
			a.updateView()
			a.saveViewChange()
			if next == 0 || p.backoff < next {
				next = p.backoff
			}
			continue
		}
		for ref := range p.refs {
			if d := a.state.Archives[name].Refs[ref]; d != recorded[ref] {
				logrus.Infof("%s now holds %s at %s (was %s): imported the update", name, ref, d, recorded[ref])
			}
		}
		a.metrics.restores.WithLabelValues("ok").Inc()
		a.state.Agent.RestoresDone++
		// It loaded whole: a failure a sync recorded for it (a full disk meanwhile) is over.
		delete(a.state.Agent.ArchiveErrors, name)
		took := time.Since(start).Round(time.Millisecond)
		logrus.Infof("restored %d reference(s) from %s in %s", len(p.refs), name, took)
		a.event(false, ReasonImageRestored, "restored %s from %s in %s", firstFew(slices.Sorted(maps.Keys(p.refs))), name, took)
		for ref := range p.refs {
			a.trackCreated(ref)
		}
		delete(pending, name)
		a.updateView() // what status and doctor read: this one is no longer pending
		a.saveState()
	}
	return next
}

func restoreError(rep ArchiveReport, refs map[string]bool) error {
	var errs []error
	if rep.Err != nil {
		errs = append(errs, rep.Err)
	}
	got := map[string]bool{}
	for _, r := range rep.Refs {
		if r.Err == nil {
			got[r.Ref] = true
		}
	}
	for ref := range refs {
		if !got[ref] {
			errs = append(errs, fmt.Errorf("%s not brought back", ref))
		}
	}
	return errors.Join(errs...)
}

// updateView puts the restores and fetches waiting into the agent's view.
func (a *Agent) updateView() {
	pending, fetches := a.toRestore, a.toFetch
	a.state.Agent.RestoresPending, a.state.Agent.WaitingForDisk, a.state.Agent.FetchesPending = nil, nil, nil
	for _, p := range pending {
		for ref := range p.refs {
			a.state.Agent.RestoresPending = append(a.state.Agent.RestoresPending, ref)
			if p.noSpace {
				a.state.Agent.WaitingForDisk = append(a.state.Agent.WaitingForDisk, ref)
			}
		}
	}
	for _, p := range fetches {
		for ref := range p.refs {
			a.state.Agent.FetchesPending = append(a.state.Agent.FetchesPending, ref)
			if p.noSpace {
				a.state.Agent.WaitingForDisk = append(a.state.Agent.WaitingForDisk, ref)
			}
		}
	}
	slices.Sort(a.state.Agent.RestoresPending)
	slices.Sort(a.state.Agent.WaitingForDisk)
	slices.Sort(a.state.Agent.FetchesPending)
}

// isNoSpace reports a full disk, the state in which restores must wait rather than spin. Only
// here is an error told by its text: a full disk in containerd's root reaches a client as a gRPC
// status with code Unknown (errdefs has no class for ENOSPC, and errgrpc keeps only the message);
// in-process (containerd's metadata store in tests) it is syscall.ENOSPC.
func isNoSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || (err != nil && strings.Contains(err.Error(), "no space left"))
}

// watchEvents forwards containerd's image events for namespace ns. When the stream breaks
// (containerd restarted) it waits for containerd with capped backoff, subscribes again and asks
// for a full reconcile, since events were missed meanwhile.
func (a *Agent) watchEvents(ctx context.Context, ns string, out chan<- any, resync func()) {
	filter := fmt.Sprintf(`namespace==%q,topic~="^/images/"`, ns)
	wait := 100 * time.Millisecond
	first := true
	for ctx.Err() == nil {
		serveCtx, cancel := context.WithTimeout(ctx, time.Second)
		serving, _ := a.cd.Events.IsServing(serveCtx)
		cancel()
		if !serving {
			select {
			case <-ctx.Done():
			case <-time.After(wait):
			}
			wait = min(2*wait, reconnectMax)
			continue
		}
		subCtx, cancelSub := context.WithCancel(ctx)
		evs, errs := a.cd.Events.Subscribe(subCtx, filter)
		if !first {
			logrus.Info("containerd is back: events resumed, reconciling")
			resync()
		}
		first, wait = false, 100*time.Millisecond
	stream:
		for {
			select {
			case env := <-evs:
				ev, err := typeurl.UnmarshalAny(env.Event)
				if err == nil {
					select {
					case out <- ev:
					case <-ctx.Done():
					}
				}
			case err := <-errs:
				if ctx.Err() == nil {
					logrus.Warnf("containerd event stream ended: %v; reconnecting", err)
				}
				break stream
			case <-ctx.Done():
				break stream
			}
		}
		cancelSub()
	}
}

// watchDir asks for a reconcile when files of the images dir change, once writes have settled.
func (a *Agent) watchDir(ctx context.Context, resync func()) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		logrus.Errorf("watch %s: %v; relying on the periodic reconcile", a.cfg.ImagesDir, err)
		return
	}
	defer w.Close()
	for ctx.Err() == nil {
		if err := w.Add(a.cfg.ImagesDir); err == nil {
			break
		}
		select { // the dir may not exist yet: k3s creates it on demand
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Second):
		}
	}
	settle := time.NewTimer(time.Hour)
	settle.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-w.Events:
			if ev.Op != fsnotify.Chmod {
				settle.Reset(fsSettle)
			}
		case err := <-w.Errors:
			logrus.Warnf("watch %s: %v", a.cfg.ImagesDir, err)
		case <-settle.C:
			resync()
		}
	}
}
