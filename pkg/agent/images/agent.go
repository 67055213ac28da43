// Package images is the agent side of k3s-pinning: it keeps what the k3s air-gap images dir
// provides (read by package airgap) present and pinned in containerd. The data path, top to
// bottom: archives are read into indexes (airgap), imported with the pin set at creation
// (importer, through pinning.Pinner), recorded (State), and the keep-decision (Plan) drives
// reconcile, restore, the adoption of k3s's pins and the kubelet's GC filter (Keeper).
package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/errdefs"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// DefaultImagesDir is where k3s loads air-gap images from.
const DefaultImagesDir = "/var/lib/rancher/k3s/agent/images"

// Containerd is what the agent uses of containerd, each part one of containerd's own narrow
// interfaces, so that the agent's logic runs on any implementation of them: a daemon's (Services),
// or containerd's metadata store opened in a test.
type Containerd struct {
	Images  images.Store
	Content content.Store
	Leases  leases.Manager
	// CRI pulls the entries of .txt lists (so registry mirrors and credentials apply); nil: lists
	// fail with an error naming the file.
	CRI runtimeapi.ImageServiceClient
	// Events are the image events Run follows; nil: Run reconciles on its period only.
	Events Events
}

// Events is containerd's event stream and whether containerd answers (a *containerd.Client).
type Events interface {
	Subscribe(ctx context.Context, filters ...string) (<-chan *events.Envelope, <-chan error)
	IsServing(ctx context.Context) (bool, error)
}

// Services are the parts of a containerd daemon the agent uses, all on client's connection: the
// CRI image service too, since containerd serves it on its own socket.
func Services(client *containerd.Client) Containerd {
	cd := Containerd{Images: client.ImageService(), Content: client.ContentStore(), Leases: client.LeasesService(), Events: client}
	if conn, ok := client.Conn().(*grpc.ClientConn); ok {
		cd.CRI = runtimeapi.NewImageServiceClient(conn)
		cd.Images = streamedImages{Store: cd.Images, conn: conn}
	}
	return cd
}

// Config is what the agent protects: the images dir, the policy beyond it, and k3s's retag
// registries.
type Config struct {
	ImagesDir       string
	Policy          *pinning.Policy
	ExtraRegistries []string
	// StateFile keeps what each archive provided across restarts (DefaultStateFile for the
	// daemon). Empty: the state lives in memory only, and each process starts by re-indexing.
	StateFile string
	// Reporter, when set, is told the agent's events and the node's protection (the cluster
	// package: Events and a condition on the Node).
	Reporter Reporter
	// Fetch fetches a wanted image that is missing and that no archive here provides, by
	// digest, through the CRI (PolicyValues.FetchMissingImages); FetchMaxDiskUsage bounds it.
	Fetch             bool
	FetchMaxDiskUsage int
	// RetainRemoved keeps what a removed archive provided (PolicyValues.RetainRemovedArchiveImages).
	RetainRemoved bool
	// MaxWorkloadImages bounds the references kept for workloads alone (0: DefaultMaxWorkloadImages),
	// MaxWorkloadImageBytes their images' bytes (0: no bound).
	MaxWorkloadImages     int
	MaxWorkloadImageBytes int64
	// ImagefsUsage says how full the image filesystem is; nil: the CRI's ImageFsInfo mount
	// point, measured with statfs, as the kubelet measures it.
	ImagefsUsage func(ctx context.Context) (DiskUsage, error)
}

// AgentConfig is the part of the agent's Config these values set.
func (v PolicyValues) AgentConfig(cfg Config) Config {
	cfg.Fetch, cfg.RetainRemoved, cfg.FetchMaxDiskUsage = v.FetchMissingImages, v.RetainRemovedArchiveImages, v.FetchMaxDiskUsage
	cfg.MaxWorkloadImages = v.MaxWorkloadImages
	cfg.MaxWorkloadImageBytes, _ = v.maxWorkloadImageBytes() // checked with the flags
	return cfg
}

// Agent keeps the images of the images dir, and those the policy names, present and pinned. Its
// exported methods may be called from several goroutines, also while Run runs: they take turns.
type Agent struct {
	cd       Containerd
	cfg      Config
	importer *importer
	pinner   *pinning.Pinner
	keeper   *Keeper
	metrics  *agentMetrics

	mu    sync.Mutex // guards what follows
	state *State
	// present and read are the images dir as last surveyed: archive names, and the indexes read
	// from them (an archive that could not be read is absent from read).
	present []string
	read    map[string]*airgap.Index
	plan    *Plan
	listed  bool // plan was resolved against a containerd list (adoptK3sPins needs that)
	track   tracker
	// workloadImages are the references the workloads in scope name, normalized, with the
	// workloads naming each; nil: not known. workloads are those of them admitted to the plan
	// (admitWorkloads); refused says why each other one is not, as last reported.
	workloadImages WorkloadImages
	workloads      map[string]bool
	refused        map[string]string
	// workloadBytes are the bytes of the images admitted for workloads alone and present, as of
	// the last admission; sizes remembers image sizes by target for it.
	workloadBytes int64
	sizes         map[digest.Digest]int64
	resync        chan struct{} // a full sync requested (the images dir, containerd, the workloads)
	// agentLock, held open, makes this the one live agent of its state file; importLeasesDone:
	// ownImportLeases has run (it runs once).
	agentLock        *os.File
	importLeasesDone bool
	// toRestore and toFetch are what Run has waiting: restores by archive, fetches by the
	// repo@digest pulled (nil outside Run).
	toRestore map[string]*pendingRestore
	toFetch   map[string]*pendingFetch
	// retainedSeen are the retained references as the state file last had them (reloadRetained).
	retainedSeen map[string]map[string]bool
	// stateLost: the agent started without a state it could read, so the first sync reads back
	// from containerd's pins what was retained (rebuildRetained). stateUnreadable is why, while
	// the unreadable file is still where it was; stateSeen is the file as the agent last read or
	// wrote it (keepAsideUnreadable).
	stateLost       bool
	stateUnreadable error
	stateSeen       os.FileInfo
	// savedWork is what the last save wrote of the agent's waiting work (saveViewChange).
	savedWork AgentView
	// pulls are the list entries Run pulls in the background (nil outside Run).
	pulls *listPulls
	// reconciled is when this process's last full sync ended (unix nanoseconds; 0: none yet),
	// read without the lock: a stuck agent holds it.
	reconciled atomic.Int64
}

// NewAgent returns an Agent on cd. The containerd namespace comes from each call's context.
func NewAgent(cd Containerd, cfg Config) *Agent {
	a := &Agent{
		cd:       cd,
		cfg:      cfg,
		importer: &importer{cd: cd, pinner: pinning.NewPinner(cd.Images), extraRegistries: cfg.ExtraRegistries},
		pinner:   pinning.NewPinner(cd.Images),
		keeper:   &Keeper{},
		metrics:  newMetrics(),
		track:    tracker{missing: map[string]bool{}, lost: map[string]bool{}},
		resync:   make(chan struct{}, 1),
	}
	a.openState()
	// Before the first reconcile, every archive recorded is taken as present, so that a kubelet
	// starting beside the agent never sees a gap.
	a.noteRetained()
	a.present, a.read = slices.Collect(maps.Keys(a.state.Archives)), map[string]*airgap.Index{}
	a.plan = a.newPlan(a.present, a.read)
	a.keeper.publish(a.plan, nil)
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

// Metrics are the agent's Prometheus metrics, for the program to register where it serves them.
func (a *Agent) Metrics() prometheus.Collector { return a.metrics }

// saveState writes the state if a file is configured. A failure (full or read-only disk) is
// reported in the agent's view and otherwise ignored: protection goes on from memory.
func (a *Agent) saveState() {
	if a.cfg.StateFile == "" {
		return
	}
	a.state.Agent.StateError = ""
	err := withStateLock(a.cfg.StateFile, a.writeStateLocked)
	if err != nil {
		a.state.Agent.StateError = err.Error()
		logrus.Errorf("%v; protecting from memory", err)
	}
}

// writeStateLocked is a save, its caller holding the state lock.
func (a *Agent) writeStateLocked() error {
	if err := a.keepAsideUnreadable(); err != nil {
		return err
	}
	// An unpin by another process since the last save is not written back; read under the
	// lock, so that one between this read and the write waits for the write, and is applied at
	// the next.
	a.reloadRetained()
	if err := a.state.write(a.cfg.StateFile); err != nil {
		return err
	}
	a.stateSeen, _ = os.Stat(a.cfg.StateFile)
	a.noteRetained()
	a.savedWork = workOf(a.state.Agent)
	return nil
}

// saveViewChange saves the state when what status and doctor show of the agent's waiting work
// changed since the last save: a restore or fetch failing again the same way, at each retry,
// writes nothing (the whole file, with fsync, for one counter).
func (a *Agent) saveViewChange() {
	a.updateView()
	if !reflect.DeepEqual(workOf(a.state.Agent), a.savedWork) {
		a.saveState()
	}
}

// workOf is the part of view that says what waits and why, empty parts as nil.
func workOf(view AgentView) AgentView {
	orNil := func(s []string) []string {
		if len(s) == 0 {
			return nil
		}
		return slices.Clone(s)
	}
	mapOrNil := func(m map[string]string) map[string]string {
		if len(m) == 0 {
			return nil
		}
		return maps.Clone(m)
	}
	return AgentView{RestoresPending: orNil(view.RestoresPending), WaitingForDisk: orNil(view.WaitingForDisk), FetchesPending: orNil(view.FetchesPending),
		ArchiveErrors: mapOrNil(view.ArchiveErrors), FetchErrors: mapOrNil(view.FetchErrors)}
}

// newPlan is the keep-decision for the archives present, with the indexes read from them.
func (a *Agent) newPlan(present []string, read map[string]*airgap.Index) *Plan {
	return newPlan(a.planInput(present, read))
}

// planInput is what the plan for the archives present, with the indexes read from them, is made of.
func (a *Agent) planInput(present []string, read map[string]*airgap.Index) planInput {
	return planInput{present: present, read: read, recorded: a.state.Archives, policy: a.cfg.Policy, extraRegistries: a.cfg.ExtraRegistries, workloads: a.workloads, retained: a.state.Retained}
}

// requestSync asks Run for a full sync; requests made while one is pending are one.
func (a *Agent) requestSync() {
	select {
	case a.resync <- struct{}{}:
	default:
	}
}

// SetWorkloadImages sets the images the workloads in scope reference (--pinned-workload-images:
// pod templates of Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs, CronJobs, and Pods),
// as their specs write them, and has Run sync: those admitted within the limits are pinned
// (admitWorkloads), and pins set for a workload no longer there are released. Until it is first
// called, workload pins are kept as they are. A reference that does not parse is skipped.
func (a *Agent) SetWorkloadImages(imgs WorkloadImages) {
	named := make(WorkloadImages, len(imgs))
	for r, owners := range imgs {
		if n, err := reference.ParseDockerRef(r); err == nil {
			named[n.String()] = append(named[n.String()], owners...)
		}
	}
	a.mu.Lock()
	a.workloadImages = named
	a.mu.Unlock()
	logrus.Infof("the workloads in scope name %d image reference(s): reconciling", len(named))
	a.requestSync()
}

// replan makes the plan again from the last survey and the state, after the state changed.
func (a *Agent) replan() { a.plan = a.newPlan(a.present, a.read) }

// ArchiveReport is what Sync did with one archive.
type ArchiveReport struct {
	Archive  airgap.Archive
	Format   airgap.Format
	Imported bool // content was imported (tarball) or pulled (list)
	Refs     []RefResult
	Shadowed []Conflict // references this archive also provides, loaded from an earlier one
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
		pinned, err := a.pinner.PinWanted(ctx, listed.images(), a.plan.Source)
		report.PolicyErr = errors.Join(err, a.releaseUnwanted(ctx, listed))
		for _, ref := range slices.Sorted(maps.Keys(pinned)) {
			if pinned[ref] == pinning.SourcePolicy {
				report.PolicyPinned = append(report.PolicyPinned, ref)
				logrus.Infof("pinned %s: --pinned-images/--pinned-image-labels want it", ref)
			} else {
				logrus.Infof("pinned %s again (%s wants it)", ref, pinned[ref])
			}
		}
		a.keeper.publish(a.plan, listed)
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
	forgetDigestRefs()
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
func (a *Agent) releaseUnwanted(ctx context.Context, listed imageRecords) error {
	var errs []error
	for img := range listed.images() {
		src, ours := pinning.OwnPin(img.Labels)
		if !ours || src == pinning.SourcePolicy || src == pinning.SourceManual || isImageIDRecord(img.Name) {
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
	known := map[Conflict]bool{}
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
func (a *Agent) storeAfterLoads(ctx context.Context, snap *storeSnapshot, releases []release) (imageRecords, error) {
	if listed, ok := snap.take(); ok && len(releases) == 0 {
		return listed, nil
	}
	listed, err := listRecords(ctx, a.cd.Images)
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
	forgetDigestRefs()
	return rep
}

// load imports and pins what ar provides (idx, as read with indexErr), except the references
// another archive owns, and records it; snap is the store as this sync or restore listed it.
// It returns what the archive's previous content provided and it no longer does, to release once
// the plan is made again.
func (a *Agent) load(ctx context.Context, snap *storeSnapshot, ar airgap.Archive, idx *airgap.Index, contentDigest digest.Digest, indexErr error) (ArchiveReport, []release) {
	rep := a.importArchive(ctx, snap, ar, idx, indexErr)
	return rep, a.recordArchive(rep, idx, contentDigest)
}

// importArchive is load's first half: it imports and pins, and only reads the agent (its plan),
// so that archives are imported side by side.
func (a *Agent) importArchive(ctx context.Context, snap *storeSnapshot, ar airgap.Archive, idx *airgap.Index, indexErr error) ArchiveReport {
	rep := ArchiveReport{Archive: ar}
	if idx == nil {
		rep.Err = indexErr
		logrus.Errorf("%v", indexErr)
		return rep
	}
	rep.Format, rep.Shadowed = idx.Format, a.plan.owners.shadowed(ar.Name())
	refs, imported, loadErr := a.importer.Load(ctx, a.plan.owners.loadable(idx), snap, a.plan.owners.of)
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
	if rec.unchanged(ar) {
		return rec.index(ar), rec.Digest, nil
	}
	if rec == nil && !ar.IsList() {
		// Never recorded: no digest to compare with, and no need of one to load it (a touched
		// archive is read again anyway, and its images found present). Its index alone is read,
		// of an uncompressed archive only the metadata: a cold load read and hashed each archive
		// whole before importing it, which reads it again (for the 1 GiB set, a gigabyte read and
		// hashed for nothing).
		idx, err := airgap.ReadIndex(ar, airgap.FileOpener(ar))
		return idx, "", err
	}
	idx, d, err := airgap.ReadFile(ar)
	if rec != nil && !rec.Incomplete && d != "" && rec.Digest == d {
		return rec.index(ar), d, nil
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
	rec := &ArchiveState{Size: ar.Size, ModTime: ar.ModTime, Digest: contentDigest, Format: idx.Format, Refs: map[string]digest.Digest{}}
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

// View is the agent's own view (last reconcile, restores, failures).
func (a *Agent) View() AgentView {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.state.Agent
}

// PinManual pins ref by hand (`k3s-pinning pin`), recorded as SourceManual.
func (a *Agent) PinManual(ctx context.Context, ref string) (pinning.PinResult, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	img, err := a.existing(ctx, ref)
	if err != nil {
		return 0, err
	}
	return a.pinner.PinImage(ctx, img, pinning.SourceManual)
}

// UnpinManual removes our pin from ref (`k3s-pinning unpin`). It never removes a pin we did not
// set. wantedBy names what still wants ref kept, so the caller can say that sync will pin it again.
func (a *Agent) UnpinManual(ctx context.Context, ref string) (wantedBy string, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	img, err := a.existing(ctx, ref)
	if err != nil {
		return "", err
	}
	// A retained archive's image is kept until it is unpinned: every name the archive gave it
	// goes with the one named, so that nothing pins it again. The file is read again, changed and
	// written in one turn of its lock: the running agent may have retained more since this process
	// started, and a save of its own between the read and the write would be lost.
	var dropped []string
	unpin := func() error {
		if err := a.pinner.Unpin(ctx, img.Name); err != nil {
			return err
		}
		dropped = a.dropRetained(img.Name)
		return nil
	}
	if a.cfg.StateFile == "" {
		err = unpin()
	} else {
		err = withStateLock(a.cfg.StateFile, func() error {
			fresh, err := LoadState(a.cfg.StateFile)
			if err != nil {
				// Which names a retained archive gave the image is in the file alone: without
				// them the running agent would pin the others again, and this process must not
				// write a file it could not read.
				if src := a.retainedCandidate(img); src != "" {
					return fmt.Errorf("unpin %s: pinned for %s, which is not in the images dir, and what it retained cannot be read (%w): run `k3s-pinning sync` (or wait for the running agent's next reconcile), which writes the state again, then unpin again", img.Name, src, err)
				}
				return a.pinner.Unpin(ctx, img.Name)
			}
			a.state.Retained = fresh.Retained
			a.noteRetained()
			if err := unpin(); err != nil || len(dropped) == 0 {
				return err
			}
			return fresh.write(a.cfg.StateFile)
		})
	}
	if err != nil {
		return "", err
	}
	for _, name := range dropped {
		if name == img.Name {
			continue
		}
		if err := a.pinner.Unpin(ctx, name); err != nil && !errdefs.IsNotFound(err) && !errors.Is(err, pinning.ErrNotOurs) {
			return "", err
		}
		logrus.Infof("unpinned %s too: a removed archive retained it with %s", name, img.Name)
	}
	sv := a.survey()
	return a.newPlan(sv.present, sv.read).Heir(img, pinning.SourceManual), nil
}

// retainedCandidate is the archive our pin on img names when that archive is not in the images
// dir: the image may be one it retained.
func (a *Agent) retainedCandidate(img images.Image) string {
	src, ours := pinning.OwnPin(img.Labels)
	if !ours || !pinning.IsArchiveSource(src) {
		return ""
	}
	if _, err := os.Stat(filepath.Join(a.cfg.ImagesDir, src)); err == nil {
		return ""
	}
	return src
}

// reloadRetained applies what `k3s-pinning unpin`, run as another process beside this agent,
// dropped from the retained archives in the state file since this agent last read or wrote it: a
// reference this agent saw there and the file no longer holds is dropped; what it retained since
// stays. Only when this agent's last save succeeded: otherwise the file is older than its memory.
func (a *Agent) reloadRetained() {
	// Nothing retained here, nothing another process could have dropped: no read of the file
	// (the start-up sync and every save of a node that never retained anything).
	if a.cfg.StateFile == "" || a.state.Agent.StateError != "" || len(a.state.Retained) == 0 {
		return
	}
	s, err := LoadState(a.cfg.StateFile)
	if err != nil {
		return
	}
	for name, rec := range a.state.Retained {
		onFile := s.Retained[name]
		for ref := range rec.Refs {
			if a.retainedSeen[name][ref] && (onFile == nil || onFile.Refs[ref] == "") {
				delete(rec.Refs, ref)
			}
		}
		rec.Images = slices.DeleteFunc(rec.Images, func(img airgap.IndexedImage) bool { _, kept := rec.Refs[img.Ref]; return !kept })
		if len(rec.Refs) == 0 {
			delete(a.state.Retained, name)
		}
	}
	a.noteRetained()
}

// noteRetained records the retained references as the state file has them now.
func (a *Agent) noteRetained() {
	a.retainedSeen = map[string]map[string]bool{}
	for name, rec := range a.state.Retained {
		a.retainedSeen[name] = map[string]bool{}
		for ref := range rec.Refs {
			a.retainedSeen[name][ref] = true
		}
	}
}

// dropRetained removes ref, and every other name a retained archive recorded for the same image,
// from the retained archives (an archive left with nothing is forgotten). It returns the names
// dropped; the caller saves.
func (a *Agent) dropRetained(ref string) []string {
	var dropped []string
	for _, name := range slices.Sorted(maps.Keys(a.state.Retained)) {
		rec := a.state.Retained[name]
		d, ok := rec.Refs[ref]
		if !ok {
			continue
		}
		for r, rd := range rec.Refs {
			if rd == d {
				delete(rec.Refs, r)
				dropped = append(dropped, r)
			}
		}
		rec.Images = slices.DeleteFunc(rec.Images, func(img airgap.IndexedImage) bool { _, kept := rec.Refs[img.Ref]; return !kept })
		if len(rec.Refs) == 0 {
			delete(a.state.Retained, name)
			logrus.Infof("%s: nothing retained any more; forgotten", name)
		}
	}
	return dropped
}

// existing is the image ref names, as given or in its normalized form (nginx:1 is
// docker.io/library/nginx:1).
func (a *Agent) existing(ctx context.Context, ref string) (images.Image, error) {
	img, err := a.cd.Images.Get(ctx, ref)
	if errdefs.IsNotFound(err) {
		if n := normalize(ref); n != ref {
			img, err = a.cd.Images.Get(ctx, n)
		}
	}
	if errdefs.IsNotFound(err) {
		return images.Image{}, fmt.Errorf("image %s: not found in containerd", ref)
	}
	if err != nil {
		return images.Image{}, fmt.Errorf("image %s: %w", ref, err)
	}
	return img, nil
}
