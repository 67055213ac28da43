package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"runtime"
	"slices"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/sirupsen/logrus"
	"golang.org/x/sync/errgroup"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/keep"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// ArchiveReport is what Sync did with one archive.
type ArchiveReport struct {
	Archive  airgap.Archive
	Format   airgap.Format
	Imported bool // content was imported (tarball) or pulled (list)
	Refs     []RefResult
	Shadowed []keep.Conflict // references this archive also provides, loaded from an earlier one
	Err      error
}

// SyncReport is what Sync did.
type SyncReport struct {
	Archives     []ArchiveReport
	ScanErrors   []error  // files of the images dir that are not archives k3s loads
	PolicyPinned []string // hand-imported references pinned because the policy wants them
	PolicyErr    error
}

// Err joins every error of the report; nil means every archive was processed in full.
func (r *SyncReport) Err() error {
	errs := append([]error{}, r.ScanErrors...)
	for _, a := range r.Archives {
		errs = append(errs, a.Err)
		for _, ref := range a.Refs {
			if ref.Err != nil && ref.Err != errPullPending && !errors.Is(a.Err, ref.Err) {
				errs = append(errs, ref.Err)
			}
		}
	}
	return errors.Join(append(errs, r.PolicyErr)...)
}

// survey is the images dir as read now.
type survey struct {
	archives []airgap.Archive
	present  []string // archive names; every recorded one when the dir cannot be read
	read     map[string]*airgap.Index
	digests  map[string]digest.Digest // content digest of each archive read
	errs     map[string]error         // why an archive could not be read (in full, for lists)
	scanErrs []error
}

// survey scans the images dir and indexes every archive: which archive provides a reference is
// decided over all of them before any is loaded (ownership).
func (a *Agent) survey() *survey {
	sv := &survey{read: map[string]*airgap.Index{}, digests: map[string]digest.Digest{}, errs: map[string]error{}}
	sv.archives, sv.scanErrs = airgap.Scan(a.cfg.ImagesDir)
	for _, err := range sv.scanErrs {
		if errors.Is(err, airgap.ErrDirUnreadable) {
			// Not an empty dir: nothing left it. Every recorded archive keeps what it provided
			// until the dir can be read again.
			sv.present = append(sv.present, slices.Collect(maps.Keys(a.state.Archives))...)
		}
	}
	type indexed struct {
		idx *airgap.Index
		d   digest.Digest
		err error
	}
	all := make([]indexed, len(sv.archives))
	parallel(len(sv.archives), func(i int) {
		all[i].idx, all[i].d, all[i].err = a.index(sv.archives[i])
	})
	for i, ar := range sv.archives {
		sv.present = append(sv.present, ar.Name())
		if all[i].idx != nil {
			sv.read[ar.Name()], sv.digests[ar.Name()] = all[i].idx, all[i].d
		}
		if all[i].err != nil {
			sv.errs[ar.Name()] = all[i].err
		}
	}
	return sv
}

// parallel calls f(0) to f(n-1), as many at a time as the node has CPUs: reading an archive is
// hashing and decompressing it, and a 2-core node reads two at once.
func parallel(n int, f func(i int)) {
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for i := range n {
		g.Go(func() error { f(i); return nil })
	}
	g.Wait()
}

// Sync imports what the images dir holds and containerd lacks, pins every reference the images
// dir provides, then pins what the policy wants. One bad archive never stops the others, and no
// pin is ever removed but ours, when what it recorded no longer wants the image.
func (a *Agent) Sync(ctx context.Context) *SyncReport {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.sync(ctx)
}

func (a *Agent) sync(ctx context.Context) *SyncReport {
	a.ownImportLeases(ctx)
	a.reloadRetained()
	start := time.Now()
	defer func() { a.metrics.reconcile.Observe(time.Since(start).Seconds()) }()
	snap := listedStore() // one list of the store verifies every unchanged archive
	defer snap.endImports(ctx, a.importer)
	a.importer.listFirst(ctx, snap)
	sv := a.survey()
	report := &SyncReport{ScanErrors: sv.scanErrs}
	for _, err := range sv.scanErrs {
		logrus.Errorf("images dir: %v", err)
		if errors.Is(err, airgap.ErrDirUnreadable) {
			logrus.Errorf("images dir %s cannot be read: keeping every image its archives provided", a.cfg.ImagesDir)
		}
	}
	a.present, a.read = sv.present, sv.read
	a.setPlan()
	var releases []release
	// Tarballs before lists: a list entry that a tarball provides is then present, not pulled.
	// Archives are imported side by side, then recorded in order; a reference two of them provide
	// with the same image is pinned for the first by name, whichever creates it.
	if a.pulls != nil {
		a.pulls.beginSync()
		defer a.pulls.endSync()
	}
	for _, lists := range []bool{false, true} {
		var batch []airgap.Archive
		for _, ar := range sv.archives {
			if ar.IsList() == lists {
				batch = append(batch, ar)
			}
		}
		reps := make([]ArchiveReport, len(batch))
		parallel(len(batch), func(i int) {
			ar := batch[i]
			reps[i] = a.importArchive(ctx, snap, ar, sv.read[ar.Name()], sv.errs[ar.Name()])
		})
		for i, ar := range batch {
			report.Archives = append(report.Archives, reps[i])
			releases = append(releases, a.recordArchive(reps[i], sv.read[ar.Name()], sv.digests[ar.Name()])...)
		}
	}
	for _, name := range a.present {
		delete(a.state.Retained, name) // back in the dir: its record now is the archive's
	}
	for _, name := range slices.Sorted(maps.Keys(a.state.Archives)) {
		if !slices.Contains(a.present, name) && a.cfg.RetainRemoved {
			// k3s issue 11363: an operator removes an archive to save disk, not to let its
			// images go. They stay pinned under the archive's name until unpin.
			logrus.Infof("%s left the images dir: its %d reference(s) stay pinned, retained (--%s), until `k3s-pinning unpin`", name, len(a.state.Archives[name].Refs), FlagRetainRemoved)
			a.state.Retained[name] = a.state.Archives[name]
			delete(a.state.Archives, name)
			continue
		}
		if !slices.Contains(a.present, name) {
			logrus.Infof("%s left the images dir: unpinning what only it wanted", name)
			releases = append(releases, release{source: name, had: a.state.Archives[name].Refs})
			delete(a.state.Archives, name)
		}
	}
	a.replan()
	a.release(ctx, releases)
	// One list of the store serves the pins the plan still lacks (hand imports the policy names,
	// a reference whose pin was stripped) and the kubelet's GC filter.
	listed, err := a.storeAfterLoads(ctx, snap, releases)
	if err != nil {
		report.PolicyErr = err
	} else {
		if a.stateLost {
			a.rebuildRetained(listed)
		}
		a.admitWorkloads(ctx, listed)
		pinned, err := a.pinner.PinWanted(ctx, listed.Images(), a.plan.Source)
		report.PolicyErr = errors.Join(err, a.releaseUnwanted(ctx, listed))
		for _, ref := range slices.Sorted(maps.Keys(pinned)) {
			if pinned[ref] == pinning.SourcePolicy {
				report.PolicyPinned = append(report.PolicyPinned, ref)
				logrus.Infof("pinned %s: --pinned-images/--pinned-image-labels want it", ref)
			} else {
				logrus.Infof("pinned %s again (%s wants it)", ref, pinned[ref])
			}
		}
		a.keeper.Publish(a.plan, listed)
		a.listed = true
		a.trackListed(listed)
	}
	if report.PolicyErr != nil {
		logrus.Errorf("policy: %v; the kubelet's GC filter keeps answering from the last reconcile", report.PolicyErr)
	}
	a.metrics.observeReferences(report)
	a.state.Agent.LastReconcile = time.Now()
	before := a.state.Agent.ArchiveErrors
	a.state.Agent.ArchiveErrors = map[string]string{}
	for _, ar := range report.Archives {
		if ar.Err != nil {
			name, msg := ar.Archive.Name(), ar.Err.Error()
			a.state.Agent.ArchiveErrors[name] = msg
			if before[name] != msg { // each failure once, not at every reconcile
				a.event(true, ReasonArchiveLoadFailed, "%s in %s: %s", name, a.cfg.ImagesDir, msg)
			}
		}
	}
	a.saveState()
	a.reportProtection()
	a.digestRefs.Forget()
	a.reconciled.Store(time.Now().UnixNano())
	return report
}

// Reconciled is when this agent's last full sync (a reconcile) ended; zero before the first. It
// never waits for the agent: what probes of its liveness ask.
func (a *Agent) Reconciled() time.Time {
	if n := a.reconciled.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// releaseUnwanted removes every pin of ours, set for an archive or a workload, that the plan no
// longer wants: the pins of a workload no longer there (once the workloads are known), and those
// an archive set on what it no longer provides. An archive's changes are released as they are
// recorded (release); this pass, at every sync, is what makes that converge when one was lost
// (the agent stopped between the record and the release, containerd restarting, the state file
// lost). Policy and manual pins are the operator's: they are not released here.
func (a *Agent) releaseUnwanted(ctx context.Context, listed imagelist.Records) error {
	var errs []error
	for img := range listed.Images() {
		src, ours := pinning.OwnPin(img.Labels)
		if !ours || src == pinning.SourcePolicy || src == pinning.SourceManual || imagelist.IsImageID(img.Name) {
			continue
		}
		if _, wanted := a.plan.Source(img); wanted {
			continue
		}
		released, err := a.pinner.Release(ctx, img.Name, src, "")
		switch {
		case err != nil:
			errs = append(errs, err)
		case !released:
		case src == pinning.SourceWorkload:
			logrus.Infof("unpinned %s: no workload of the cluster references it any more", img.Name)
		default:
			logrus.Infof("unpinned %s: %s does not provide it (a release that did not happen when it changed)", img.Name, src)
		}
	}
	return errors.Join(errs...)
}

// setPlan makes the plan for the last survey, and logs each conflict once, when it first appears.
func (a *Agent) setPlan() {
	known := map[keep.Conflict]bool{}
	if a.plan != nil {
		for _, c := range a.plan.Conflicts() {
			known[c] = true
		}
	}
	a.replan()
	for _, c := range a.plan.Conflicts() {
		if !known[c] {
			logrus.Warnf("conflict: %v; remove it from one archive, or rename them so the one you want sorts first", c)
		}
	}
}

// storeAfterLoads is the image store as the sync's loads and releases left it: the snapshot's
// list when they wrote nothing (a warm restart: one list of the store, not two), else a fresh
// one. A change by another writer since the snapshot is the events' to follow, as after any list.
// The snapshot is done with: its loads have run.
func (a *Agent) storeAfterLoads(ctx context.Context, snap *storeCache, releases []release) (imagelist.Records, error) {
	if listed, ok := snap.take(); ok && len(releases) == 0 {
		return listed, nil
	}
	listed, err := imagelist.List(ctx, a.cd.Images)
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	return listed, nil
}

// syncArchive indexes and loads one archive (a restore), under the plan of the last sync.
func (a *Agent) syncArchive(ctx context.Context, ar airgap.Archive) ArchiveReport {
	idx, d, err := a.index(ar)
	if idx != nil {
		a.read[ar.Name()] = idx
	}
	snap := lookupStore()
	rep, releases := a.load(ctx, snap, ar, idx, d, err)
	snap.endImports(ctx, a.importer)
	a.replan()
	a.release(ctx, releases)
	a.digestRefs.Forget()
	return rep
}

// load imports and pins what ar provides (idx, as read with indexErr), except the references
// another archive owns, and records it; snap is the store as this sync or restore listed it.
// It returns what the archive's previous content provided and it no longer does, to release once
// the plan is made again.
func (a *Agent) load(ctx context.Context, snap *storeCache, ar airgap.Archive, idx *airgap.Index, contentDigest digest.Digest, indexErr error) (ArchiveReport, []release) {
	rep := a.importArchive(ctx, snap, ar, idx, indexErr)
	return rep, a.recordArchive(rep, idx, contentDigest)
}

// importArchive is load's first half: it imports and pins, and only reads the agent (its plan),
// so that archives are imported side by side.
func (a *Agent) importArchive(ctx context.Context, snap *storeCache, ar airgap.Archive, idx *airgap.Index, indexErr error) ArchiveReport {
	rep := ArchiveReport{Archive: ar}
	if idx == nil {
		rep.Err = indexErr
		logrus.Errorf("%v", indexErr)
		return rep
	}
	rep.Format, rep.Shadowed = idx.Format, a.plan.Shadowed(ar.Name())
	refs, imported, loadErr := a.importer.Load(ctx, a.plan.Loadable(idx), snap, a.plan.Loader)
	idx.Content = nil // what its import needed; the agent keeps the index for its plan
	rep.Refs, rep.Imported, rep.Err = refs, imported, errors.Join(indexErr, loadErr)
	for _, r := range refs {
		switch {
		case r.Err == errPullPending:
		case r.Err != nil:
			logrus.Errorf("%s: %v", ar.Name(), r.Err)
		case r.Result == pinning.Pinned:
			logrus.Infof("pinned %s (%s) from %s", r.Ref, r.Digest, ar.Name())
		case r.Result == pinning.PinnedByOther:
			logrus.Infof("%s from %s was already pinned by another owner; left theirs", r.Ref, ar.Name())
		}
	}
	if rep.Err != nil {
		logrus.Errorf("%s: %v", ar.Name(), rep.Err)
	}
	return rep
}

// recordArchive is load's second half: it records what rep's archive provided (idx, read with
// content digest contentDigest), in turn with the other archives.
func (a *Agent) recordArchive(rep ArchiveReport, idx *airgap.Index, contentDigest digest.Digest) []release {
	if idx == nil {
		return nil // the old record and its pins stay: a broken file never unpins anything
	}
	if rep.Err != nil && len(rep.Refs) == 0 {
		// The import failed as a whole (a full disk, containerd going away): like a damaged file,
		// the old record and its pins stay, and the next sync or restore tries again.
		return nil
	}
	return a.record(rep.Archive, idx, contentDigest, rep.Refs)
}

// index is what ar provides, and the digest of its content. With the recorded size and mtime it
// comes from the state: a restart reads and imports nothing. Never recorded, its index alone is
// read. Otherwise the archive is read once, index and digest together; if only its mtime moved
// (`touch`, the usual nudge for k3s issue 2961) the recorded index stands, with the digests its
// import learnt.
func (a *Agent) index(ar airgap.Archive) (*airgap.Index, digest.Digest, error) {
	rec := a.state.Archives[ar.Name()]
	if rec.Unchanged(ar) {
		return rec.Index(ar), rec.Digest, nil
	}
	if rec == nil && !ar.IsList() {
		// Never recorded: no digest to compare with, and no need of one to load it (a touched
		// archive is read again anyway, and its images found present). Its index alone is read,
		// of an uncompressed archive only the metadata: a cold load read and hashed each archive
		// whole before importing it, which reads it again: every byte read and hashed twice.
		idx, err := airgap.ReadIndex(ar, airgap.FileOpener(ar))
		return idx, "", err
	}
	idx, d, err := airgap.ReadFile(ar)
	if rec != nil && !rec.Incomplete && d != "" && rec.Digest == d {
		return rec.Index(ar), d, nil
	}
	return idx, d, err
}

// release is what source provided before (had) and no longer does (all of it once it left).
type release struct {
	source string
	had    map[string]digest.Digest
}

// record stores what ar provided, and returns what its previous content provided and it no longer
// does (an archive replaced under the same name).
func (a *Agent) record(ar airgap.Archive, idx *airgap.Index, contentDigest digest.Digest, refs []RefResult) []release {
	old := a.state.Archives[ar.Name()]
	rec := &statefile.Archive{Size: ar.Size, ModTime: ar.ModTime, Digest: contentDigest, Format: idx.Format, Refs: map[string]digest.Digest{}}
	for _, r := range refs {
		switch {
		case r.Err == nil && r.Digest != "":
			rec.Refs[r.Ref] = digest.Digest(r.Digest)
		case r.Err != nil && old != nil && old.Refs[r.Ref] != "":
			rec.Refs[r.Ref] = old.Refs[r.Ref] // failed now: still provided, so kept and restorable
		}
		if r.Err != nil && r.Err != errPullPending {
			rec.Incomplete = true
		}
	}
	for _, img := range idx.Images {
		// A docker archive's manifest digest is known once imported, and what the import made last
		// is it: a recorded index (an unchanged archive) may hold the digest of a load whose update
		// failed, which would keep providing that old digest reference for ever.
		if d, ok := rec.Refs[img.Ref]; ok && (img.Digest == "" || idx.Format == airgap.DockerArchive) {
			img.Digest = d
		}
		rec.Images = append(rec.Images, img)
	}
	a.state.Archives[ar.Name()] = rec
	if old == nil {
		return nil
	}
	gone := map[string]digest.Digest{}
	for ref, d := range old.Refs {
		if nd, ok := rec.Refs[ref]; !ok {
			gone[ref] = d
		} else if nd != d {
			logrus.Infof("%s: %s updated from %s to %s", ar.Name(), ref, d, nd)
		}
	}
	if len(gone) == 0 {
		return nil
	}
	return []release{{source: ar.Name(), had: gone}}
}

// release gives up what each source pinned and no longer provides, after the plan was made
// again: a pin recorded as the source's passes to what the plan says wants the reference now (the
// next archive that provides it, or the policy); with nothing, it is removed. The images stay, for
// the kubelet to collect when it needs the space; a pin recorded as anyone else's is not touched.
func (a *Agent) release(ctx context.Context, releases []release) {
	for _, rel := range releases {
		for _, ref := range slices.Sorted(maps.Keys(rel.had)) {
			img, err := a.cd.Images.Get(ctx, ref)
			if errdefs.IsNotFound(err) {
				continue // gone already
			}
			if err != nil {
				logrus.Errorf("release %s from %s: %v", ref, rel.source, err)
				continue
			}
			heir := a.plan.Heir(img, rel.source)
			released, err := a.pinner.Release(ctx, ref, rel.source, heir)
			switch {
			case err != nil:
				logrus.Errorf("release %s from %s: %v", ref, rel.source, err)
			case !released:
			case heir != "":
				logrus.Infof("%s: %s no longer provides it; %s still wants it", ref, rel.source, heir)
			default:
				logrus.Infof("unpinned %s: %s no longer provides it", ref, rel.source)
			}
		}
	}
}
