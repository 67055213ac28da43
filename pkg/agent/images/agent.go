package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/opencontainers/go-digest"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Config is what the agent protects: the images dir, the policy beyond it, and k3s's retag
// registries.
type Config struct {
	ImagesDir       string
	Policy          *pinning.Policy
	ExtraRegistries []string
	// StateFile keeps what each archive provided across restarts (DefaultStateFile for the
	// daemon). Empty: the state lives in memory only, and each process starts by re-indexing.
	StateFile string
}

// Agent keeps the images of the images dir, and those the policy names, present and pinned.
type Agent struct {
	client   *containerd.Client
	cfg      Config
	importer *Importer
	pinner   *pinning.Pinner
	state    *State
	keeper   *Keeper
	owners   *owners    // which archive provides each reference, as of the last sync
	wanted   *wantedSet // the keep-decision of the last sync; nil until a sync listed containerd
}

// NewAgent returns an Agent on client. The containerd namespace comes from each call's context.
func NewAgent(client *containerd.Client, cfg Config) *Agent {
	a := &Agent{
		client:   client,
		cfg:      cfg,
		importer: NewImporter(client, cfg.ExtraRegistries),
		pinner:   pinning.NewPinner(client.ImageService()),
		state:    loadState(cfg.StateFile),
		keeper:   &Keeper{policy: cfg.Policy},
		owners:   ownership(nil),
	}
	a.keeper.publishRecorded(a.state)
	return a
}

// Keeper is the agent's keep-decision for the kubelet's image garbage collector, up to date with
// its last reconcile. Programs that embed the kubelet register it as a GC filter:
//
//	keeper := agent.Keeper()
//	images.RegisterGCFilter("k3s-pinning", func(img container.Image) bool {
//		return keeper.Keep(img.ID, img.RepoTags, img.RepoDigests)
//	})
func (a *Agent) Keeper() *Keeper { return a.keeper }

func loadState(path string) *State {
	if path == "" {
		return newState()
	}
	s, err := LoadState(path)
	if err != nil {
		logrus.Warnf("%v", err)
	}
	return s
}

// saveState writes the state if a file is configured. A failure (full or read-only disk) is
// reported in the agent's view and otherwise ignored: protection goes on from memory.
func (a *Agent) saveState() {
	if a.cfg.StateFile == "" {
		return
	}
	a.state.Agent.StateError = ""
	if err := a.state.Save(a.cfg.StateFile); err != nil {
		a.state.Agent.StateError = err.Error()
		logrus.Errorf("%v; protecting from memory", err)
	}
}

// ArchiveReport is what Sync did with one archive.
type ArchiveReport struct {
	Archive  Archive
	Format   Format
	Imported bool // content was imported (tarball) or pulled (list)
	Refs     []RefResult
	Shadowed []Conflict // references this archive also provides, loaded from an earlier one
	Err      error
	index    *Index // what the archive provides; nil when it could not be read
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
			if ref.Err != nil && !errors.Is(a.Err, ref.Err) {
				errs = append(errs, ref.Err)
			}
		}
	}
	return errors.Join(append(errs, r.PolicyErr)...)
}

// Sync imports what the images dir holds and containerd lacks, pins every reference the images
// dir provides, then pins what the policy wants. One bad archive never stops the others, and no
// pin is ever removed.
func (a *Agent) Sync(ctx context.Context) *SyncReport {
	start := time.Now()
	defer func() { metrics.reconcile.Observe(time.Since(start).Seconds()) }()
	report := &SyncReport{}
	archives, scanErrs := Scan(a.cfg.ImagesDir)
	report.ScanErrors = scanErrs
	seen := map[string]bool{}
	for _, err := range scanErrs {
		logrus.Errorf("images dir: %v", err)
		if errors.Is(err, errDirUnreadable) {
			// Not an empty dir: nothing left it. Every recorded archive keeps what it provided
			// until the dir can be read again.
			logrus.Errorf("images dir %s cannot be read: keeping every image its archives provided", a.cfg.ImagesDir)
			for name := range a.state.Archives {
				seen[name] = true
			}
		}
	}
	// Every archive is indexed before any is loaded: which archive provides a reference is
	// decided over all of them (ownership).
	type indexed struct {
		ar         Archive
		idx        *Index
		fileDigest digest.Digest
		err        error
	}
	var all []indexed
	var claims, indexes []*Index
	for _, ar := range archives {
		seen[ar.Name()] = true
		idx, d, err := a.index(ar)
		all = append(all, indexed{ar, idx, d, err})
		if idx != nil {
			indexes = append(indexes, idx)
			claims = append(claims, idx)
		} else if rec := a.state.Archives[ar.Name()]; rec != nil {
			claims = append(claims, rec.index(ar)) // damaged now: it keeps what it loaded
		}
	}
	a.setOwners(ownership(claims))
	// Tarballs before lists: a list entry that a tarball provides is then present, not pulled.
	for _, lists := range []bool{false, true} {
		for _, x := range all {
			if x.ar.IsList() == lists {
				report.Archives = append(report.Archives, a.load(ctx, x.ar, x.idx, x.fileDigest, x.err))
			}
		}
	}
	for _, name := range slices.Sorted(maps.Keys(a.state.Archives)) {
		if !seen[name] {
			logrus.Infof("%s left the images dir: unpinning what only it wanted", name)
			old := a.state.Archives[name]
			delete(a.state.Archives, name)
			a.release(ctx, name, old.Refs, nil)
		}
	}
	// One list of the store serves the policy's pins and the kubelet's GC filter. Pins the policy
	// adds do not change what the filter keeps: the policy wants those images either way.
	listed, err := a.client.ImageService().List(ctx)
	if err != nil {
		report.PolicyErr = fmt.Errorf("list images: %w", err)
	} else {
		report.PolicyPinned, report.PolicyErr = a.pinner.PinPolicy(ctx, a.cfg.Policy, listed)
		a.wanted = newWantedSet(slices.Collect(maps.Keys(seen)), indexes, a.state, a.cfg.Policy, a.cfg.ExtraRegistries)
		a.keeper.publish(a.wanted, listed)
	}
	for _, ref := range report.PolicyPinned {
		logrus.Infof("pinned %s: --pinned-images/--pinned-image-labels want it", ref)
	}
	if report.PolicyErr != nil {
		logrus.Errorf("policy: %v; the kubelet's GC filter keeps answering from the last reconcile", report.PolicyErr)
	}
	observeReferences(report)
	a.state.Agent.LastReconcile = time.Now()
	a.state.Agent.ArchiveErrors = map[string]string{}
	for _, ar := range report.Archives {
		if ar.Err != nil {
			a.state.Agent.ArchiveErrors[ar.Archive.Name()] = ar.Err.Error()
		}
	}
	a.saveState()
	return report
}

// setOwners makes o the ownership the next loads follow, and logs each conflict once, when it
// first appears.
func (a *Agent) setOwners(o *owners) {
	known := map[Conflict]bool{}
	if a.owners != nil {
		for _, c := range a.owners.conflicts {
			known[c] = true
		}
	}
	for _, c := range o.conflicts {
		if !known[c] {
			logrus.Warnf("conflict: %v; remove it from one archive, or rename them so the one you want sorts first", c)
		}
	}
	a.owners = o
}

// syncArchive indexes and loads one archive (a restore), under the ownership of the last sync.
func (a *Agent) syncArchive(ctx context.Context, ar Archive) ArchiveReport {
	idx, d, err := a.index(ar)
	return a.load(ctx, ar, idx, d, err)
}

// load imports and pins what ar provides (idx, as read with indexErr), except the references
// another archive owns, and records it.
func (a *Agent) load(ctx context.Context, ar Archive, idx *Index, fileDigest digest.Digest, indexErr error) ArchiveReport {
	rep := ArchiveReport{Archive: ar}
	old := a.state.Archives[ar.Name()]
	if idx == nil {
		rep.Err = indexErr
		logrus.Errorf("%v", indexErr)
		return rep // the old record and its pins stay: a broken file never unpins anything
	}
	rep.Format, rep.index, rep.Shadowed = idx.Format, idx, a.owners.shadowed(ar.Name())
	refs, imported, loadErr := a.importer.Load(ctx, a.owners.loadable(idx))
	rep.Refs, rep.Imported, rep.Err = refs, imported, errors.Join(indexErr, loadErr)
	if loadErr != nil && len(refs) == 0 {
		// The import failed as a whole (a full disk, containerd going away): like a damaged file,
		// the old record and its pins stay, and the next sync or restore tries again.
		logrus.Errorf("%s: %v", ar.Name(), rep.Err)
		return rep
	}
	a.record(ctx, ar, idx, fileDigest, old, refs)
	for _, r := range refs {
		switch {
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

// index is what ar provides, and the digest of the file. With the recorded size and mtime it
// comes from the state: a restart reads, hashes and imports nothing. Otherwise the file is
// hashed, and if only its mtime moved (`touch`, the usual nudge for k3s issue 2961) the recorded
// index still stands; only new content is read.
func (a *Agent) index(ar Archive) (*Index, digest.Digest, error) {
	rec := a.state.Archives[ar.Name()]
	if rec.unchanged(ar) {
		return rec.index(ar), rec.Digest, nil
	}
	d, err := fileDigest(ar.Path)
	if err != nil {
		return nil, "", &ArchiveError{Path: ar.Path, Err: err}
	}
	if rec != nil && rec.Digest == d {
		return rec.index(ar), d, nil
	}
	idx, err := ReadIndex(ar)
	return idx, d, err
}

// record stores what ar provided, and unpins what its previous content provided and it no longer
// does (an archive replaced under the same name).
func (a *Agent) record(ctx context.Context, ar Archive, idx *Index, fileDigest digest.Digest, old *ArchiveState, refs []RefResult) {
	rec := &ArchiveState{Size: ar.Size, ModTime: ar.ModTime, Digest: fileDigest, Format: idx.Format, Refs: map[string]digest.Digest{}}
	for _, r := range refs {
		switch {
		case r.Err == nil && r.Digest != "":
			rec.Refs[r.Ref] = digest.Digest(r.Digest)
		case r.Err != nil && old != nil && old.Refs[r.Ref] != "":
			rec.Refs[r.Ref] = old.Refs[r.Ref] // failed now: still provided, so kept and restorable
		}
	}
	for _, img := range idx.Images {
		if d, ok := rec.Refs[img.Ref]; ok && img.Digest == "" {
			img.Digest = d // docker archives: the manifest digest is known once imported
		}
		rec.Images = append(rec.Images, img)
	}
	if old != nil {
		for ref, d := range old.Refs {
			if nd, ok := rec.Refs[ref]; ok && nd != d {
				logrus.Infof("%s: %s updated from %s to %s", ar.Name(), ref, d, nd)
			}
		}
	}
	a.state.Archives[ar.Name()] = rec
	if old != nil {
		a.release(ctx, ar.Name(), old.Refs, rec.Refs)
	}
}

// release gives up what source pinned and no longer provides (keep), after source's own record
// was updated or removed. A pin recorded as source's passes to the next archive that provides the
// reference, or to the policy; with neither, it is removed. The images stay, for the kubelet to
// collect when it needs the space; a pin recorded as anyone else's is not touched.
func (a *Agent) release(ctx context.Context, source string, had, keep map[string]digest.Digest) {
	store := a.client.ImageService()
	for ref := range had {
		if _, ok := keep[ref]; ok {
			continue
		}
		img, err := store.Get(ctx, ref)
		if err != nil {
			continue // gone already
		}
		if src, ours := pinning.OwnPin(img.Labels); !ours || src != source {
			continue
		}
		heir := a.archiveOf(ref)
		if heir == "" && a.cfg.Policy.Wants(img) {
			heir = pinning.SourcePolicy
		}
		if heir != "" {
			err = a.pinner.Transfer(ctx, ref, source, heir)
		} else {
			err = a.pinner.Unpin(ctx, ref)
		}
		switch {
		case err != nil:
			logrus.Errorf("release %s from %s: %v", ref, source, err)
		case heir != "":
			logrus.Infof("%s: %s no longer provides it; %s still wants it", ref, source, heir)
		default:
			logrus.Infof("unpinned %s: %s no longer provides it", ref, source)
		}
	}
}

// View is the agent's own view (last reconcile, restores, failures). Not safe while Run runs:
// other processes read it from the state file.
func (a *Agent) View() AgentView { return a.state.Agent }

// PinManual pins ref by hand (`k3s-pinning pin`), recorded as SourceManual.
func (a *Agent) PinManual(ctx context.Context, ref string) (pinning.PinResult, error) {
	name, err := a.existingName(ctx, ref)
	if err != nil {
		return 0, err
	}
	return a.pinner.Pin(ctx, name, pinning.SourceManual)
}

// UnpinManual removes our pin from ref (`k3s-pinning unpin`). It never removes a pin we did not
// set. wantedBy names what still wants ref kept, so the caller can say that sync will pin it again.
func (a *Agent) UnpinManual(ctx context.Context, ref string) (wantedBy string, err error) {
	name, err := a.existingName(ctx, ref)
	if err != nil {
		return "", err
	}
	img, err := a.client.ImageService().Get(ctx, name)
	if err != nil {
		return "", err
	}
	if err := a.pinner.Unpin(ctx, name); err != nil {
		return "", err
	}
	snap, err := a.Inspect(ctx)
	if err != nil {
		return "", nil
	}
	if src, ok := snap.wanted.source(img); ok && src != pinning.SourceManual {
		return src, nil
	}
	return "", nil
}

// existingName resolves ref as given or in its normalized form (nginx:1 is docker.io/library/nginx:1).
func (a *Agent) existingName(ctx context.Context, ref string) (string, error) {
	store := a.client.ImageService()
	if _, err := store.Get(ctx, ref); err == nil {
		return ref, nil
	}
	if n := normalize(ref); n != ref {
		if _, err := store.Get(ctx, n); err == nil {
			return n, nil
		}
	}
	return "", fmt.Errorf("image %s: not found in containerd", ref)
}
