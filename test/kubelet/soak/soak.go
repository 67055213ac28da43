// Package soak is the randomized soak of k3s-pinning: seeded, reproducible and bounded in time.
// Against a real containerd whose root is a small tmpfs, it runs the agent (as `k3s-pinning run`
// does) and injects random faults: pin labels stripped, wanted images deleted through the CRI
// and through containerd, containerd and the agent restarted, archives added, replaced, removed
// and truncated, the disk holding containerd's root filled and freed, images imported by hand,
// and the kubelet's real DeleteUnusedImages. After every step, within a bounded settle time, it
// checks the invariant: every wanted reference present (or, while the disk is full, waiting for
// a restore the agent reports) and pinned; no pin of ours on an image nobody wants; the user's
// pin and the sandbox image untouched.
package soak

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/klog/v2"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
	"github.com/k3s-pinning/k3s-pinning/test/kubelet/kubeletgc"
)

// Options bound a soak run.
type Options struct {
	Seed     uint64
	Rounds   int           // stop after this many steps (0: no bound)
	Duration time.Duration // stop after this long (0: no bound)
	// Settle bounds how long the invariant may take to hold again after a step.
	Settle time.Duration
	// ReconcileInterval is the agent's full-reconcile period (default 5 s: the soak's clock
	// runs faster than a node's; the default of `run` is 5 min).
	ReconcileInterval time.Duration
	// DiskMiB is the size of the tmpfs holding containerd's root.
	DiskMiB int
	// Faults are the kinds drawn (uniformly); nil: every kind. A few kinds make a denser run
	// around one suspect (add-archive is always added: without archives most steps act on nothing).
	Faults []Fault
}

// Fault is one kind of step.
type Fault string

const (
	StripLabel        Fault = "strip-label"
	DeleteCRI         Fault = "delete-cri"
	DeleteContainerd  Fault = "delete-containerd"
	RestartContainerd Fault = "restart-containerd"
	RestartAgent      Fault = "restart-agent"
	AddArchive        Fault = "add-archive"
	ReplaceArchive    Fault = "replace-archive"
	RemoveArchive     Fault = "remove-archive"
	TruncateArchive   Fault = "truncate-archive"
	FillDisk          Fault = "fill-disk"
	FreeDisk          Fault = "free-disk"
	HandImport        Fault = "hand-import"
	KubeletGC         Fault = "kubelet-delete-unused"
)

// Faults are every kind, as drawn (uniformly) by the soak.
var Faults = []Fault{StripLabel, DeleteCRI, DeleteContainerd, RestartContainerd, RestartAgent, AddArchive,
	ReplaceArchive, RemoveArchive, TruncateArchive, FillDisk, FreeDisk, HandImport, KubeletGC}

// Result is what a soak run did.
type Result struct {
	Seed       uint64
	Rounds     int
	Injected   map[Fault]int // faults injected, by kind
	Skipped    int           // steps drawn with nothing to act on (e.g. delete with no archive)
	Violations []string      // invariant violations, each with its round and step
	GCRemoved  int           // images the kubelet's DeleteUnusedImages removed
	MaxSettle  time.Duration // longest time the invariant took to hold again
	Elapsed    time.Duration
	Containerd string // the daemon's version
}

// archive is the soak's model of one archive in the images dir.
type archive struct {
	file    string
	refs    map[string]string // reference -> image ID (config digest) it must have
	damaged bool              // truncated: still wants what it provided, cannot restore
}

type soak struct {
	opts      Options
	rng       *rand.Rand
	dir       string
	imagesDir string
	state     string
	daemon    *containerdtest.Daemon
	client    *containerd.Client
	ctx       context.Context
	archives  map[string]*archive
	next      int // archive serial
	full      bool
	filler    string
	agentStop func()
	res       *Result
	log       io.Writer
}

const (
	userRef    = "user.example/tool:1.0" // pinned by its user: never ours to touch
	sandboxRef = "registry.example/pause:3.10"
	ns         = pinning.DefaultNamespace
)

// Run runs a soak in a new dir under os.TempDir and cleans up everything it started. log gets
// one line per step; the agent's and containerd's logs go to files in the dir, kept on failure.
func Run(ctx context.Context, opts Options, log io.Writer) (res *Result, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("soak: needs root (containerd, a tmpfs for its root)")
	}
	if opts.Settle == 0 {
		opts.Settle = 20 * time.Second
	}
	if opts.ReconcileInterval == 0 {
		opts.ReconcileInterval = 5 * time.Second
	}
	if opts.DiskMiB == 0 {
		opts.DiskMiB = 192
	}
	dir, err := os.MkdirTemp("", "k3s-pinning-soak-")
	if err != nil {
		return nil, err
	}
	s := &soak{opts: opts, rng: rand.New(rand.NewPCG(opts.Seed, 0x50a4)), dir: dir, imagesDir: filepath.Join(dir, "images"),
		state: filepath.Join(dir, "agent", "state.json"), archives: map[string]*archive{}, log: log,
		res: &Result{Seed: opts.Seed, Injected: map[Fault]int{}}}
	defer func() {
		s.cleanup()
		if err == nil && len(s.res.Violations) == 0 {
			os.RemoveAll(dir)
		} else {
			fmt.Fprintf(log, "soak: logs kept in %s\n", dir)
		}
	}()
	if err := s.setUp(ctx); err != nil {
		return nil, err
	}
	drawn := Faults
	if len(opts.Faults) > 0 {
		drawn = opts.Faults
		if !slices.Contains(drawn, AddArchive) {
			drawn = append(slices.Clone(drawn), AddArchive)
		}
	}
	start := time.Now()
	for round := 1; ; round++ {
		if (opts.Rounds > 0 && round > opts.Rounds) || (opts.Duration > 0 && time.Since(start) > opts.Duration) || ctx.Err() != nil {
			break
		}
		fault := drawn[s.rng.IntN(len(drawn))]
		what, err := s.inject(fault)
		if err != nil {
			return s.res, fmt.Errorf("round %d %s: %w", round, fault, err)
		}
		s.res.Rounds = round
		if what == "" {
			s.res.Skipped++
			continue
		}
		s.res.Injected[fault]++
		took, violation := s.settle()
		s.res.MaxSettle = max(s.res.MaxSettle, took)
		status := "ok"
		if violation != "" {
			status = "VIOLATION " + violation
			s.res.Violations = append(s.res.Violations, fmt.Sprintf("round %d (%s: %s): %s", round, fault, what, violation))
		}
		fmt.Fprintf(log, "round %4d  %-22s %-50s settled in %-8s %s\n", round, fault, what, took.Round(time.Millisecond), status)
	}
	s.res.Elapsed = time.Since(start)
	return s.res, nil
}

func (s *soak) setUp(ctx context.Context) error {
	root := filepath.Join(s.dir, "root")
	for _, d := range []string{root, s.imagesDir, filepath.Dir(s.state), filepath.Join(s.dir, "d")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := syscall.Mount("tmpfs", root, "tmpfs", 0, fmt.Sprintf("size=%dm", s.opts.DiskMiB)); err != nil {
		return fmt.Errorf("tmpfs for containerd's root: %w", err)
	}
	daemon, err := containerdtest.Start(ctx, filepath.Join(s.dir, "d"), containerdtest.Options{Root: root, SandboxImage: sandboxRef})
	if err != nil {
		return err
	}
	s.daemon, s.res.Containerd = daemon, daemon.Bin.Version
	if s.client, err = daemon.Client(); err != nil {
		return err
	}
	s.ctx = namespaces.WithNamespace(ctx, ns)
	logFile, err := os.Create(filepath.Join(s.dir, "agent.log"))
	if err != nil {
		return err
	}
	logrus.SetOutput(logFile)
	klog.LogToStderr(false)
	klog.SetOutput(logFile)
	// The sandbox image (pinned by containerd itself) and a tool its user pinned by hand.
	for _, ref := range []string{sandboxRef, userRef} {
		if err := s.handImport(ref); err != nil {
			return err
		}
	}
	img, err := s.client.ImageService().Get(s.ctx, userRef)
	if err != nil {
		return err
	}
	img.Labels = map[string]string{pinning.LabelPinned: pinning.PinnedValue}
	if _, err := s.client.ImageService().Update(s.ctx, img, "labels."+pinning.LabelPinned); err != nil {
		return err
	}
	for range 3 {
		if _, err := s.addArchive(); err != nil {
			return err
		}
	}
	s.startAgent()
	if took, v := s.settle(); v != "" {
		return fmt.Errorf("initial state not reached in %s: %s", took, v)
	}
	return nil
}

func (s *soak) cleanup() {
	if s.agentStop != nil {
		s.agentStop()
	}
	if s.client != nil {
		s.client.Close()
	}
	if s.daemon != nil {
		s.daemon.Stop()
	}
	containerdtest.UnmountUnder(s.dir)
	syscall.Unmount(filepath.Join(s.dir, "root"), syscall.MNT_DETACH)
	logrus.SetOutput(os.Stderr)
	klog.LogToStderr(true)
}

func (s *soak) startAgent() {
	ctx, cancel := context.WithCancel(s.ctx)
	done := make(chan struct{})
	agent := agentimages.NewAgent(agentimages.Services(s.client), agentimages.Config{ImagesDir: s.imagesDir, StateFile: s.state})
	go func() {
		defer close(done)
		agent.Run(ctx, agentimages.RunOptions{ReconcileInterval: s.opts.ReconcileInterval, Restore: true})
	}()
	s.agentStop = func() { cancel(); <-done }
}

// inject performs one fault and says what it acted on ("" when there was nothing to act on).
func (s *soak) inject(f Fault) (string, error) {
	store := s.client.ImageService()
	switch f {
	case StripLabel:
		ref := s.pickWanted(false)
		if ref == "" {
			return "", nil
		}
		img := images.Image{Name: ref, Labels: nil}
		_, err := store.Update(s.ctx, img, "labels."+pinning.LabelPinned, "labels."+pinning.LabelSource)
		return ref, ignoreNotFound(err)
	case DeleteCRI:
		ref := s.pickWanted(true)
		if ref == "" {
			return "", nil
		}
		_, err := s.cri().RemoveImage(s.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
		return ref, err
	case DeleteContainerd:
		ref := s.pickWanted(true)
		if ref == "" {
			return "", nil
		}
		return ref, ignoreNotFound(store.Delete(s.ctx, ref))
	case RestartContainerd:
		return "containerd", s.daemon.Restart(s.ctx)
	case RestartAgent:
		s.agentStop()
		s.startAgent()
		return "agent", nil
	case AddArchive:
		if len(s.archives) >= 6 {
			return "", nil
		}
		return s.addArchive()
	case ReplaceArchive:
		a := s.pickArchive()
		if a == nil {
			return "", nil
		}
		return a.file, s.writeArchive(a)
	case RemoveArchive:
		a := s.pickArchive()
		if a == nil || len(s.archives) <= 1 {
			return "", nil
		}
		delete(s.archives, a.file)
		return a.file, os.Remove(filepath.Join(s.imagesDir, a.file))
	case TruncateArchive:
		// Not while the disk is full: the archive's newest content may not be loaded yet, and what
		// a truncated archive keeps is what was loaded.
		a := s.pickArchive()
		if a == nil || a.damaged || s.full {
			return "", nil
		}
		path := filepath.Join(s.imagesDir, a.file)
		info, err := os.Stat(path)
		if err != nil {
			return "", err
		}
		a.damaged = true
		return a.file, os.Truncate(path, info.Size()/2)
	case FillDisk:
		if s.full {
			return "", nil
		}
		s.full = true
		return s.fill()
	case FreeDisk:
		if !s.full {
			return "", nil
		}
		s.full = false
		return "containerd root", os.Remove(s.filler)
	case HandImport:
		if s.full {
			return "", nil
		}
		ref := fmt.Sprintf("hand.example/junk-%d:1.0", s.rng.IntN(1000))
		return ref, s.handImport(ref)
	case KubeletGC:
		return s.kubeletGC()
	}
	return "", fmt.Errorf("unknown fault %s", f)
}

func ignoreNotFound(err error) error {
	if errdefs.IsNotFound(err) {
		return nil
	}
	return err
}

func (s *soak) cri() runtimeapi.ImageServiceClient {
	return runtimeapi.NewImageServiceClient(s.client.Conn().(*grpc.ClientConn))
}

// wanted is every reference the archives of the images dir must keep, with its image ID.
func (s *soak) wanted() map[string]string {
	out := map[string]string{}
	for _, a := range s.archives {
		for ref, id := range a.refs {
			out[ref] = id
		}
	}
	return out
}

// pickWanted draws a wanted reference; restorable ones only (an intact archive) when it is to be
// deleted: an image deleted while its only archive is truncated has nothing to come back from.
func (s *soak) pickWanted(restorable bool) string {
	var refs []string
	for _, a := range s.archives {
		if restorable && a.damaged {
			continue
		}
		for ref := range a.refs {
			refs = append(refs, ref)
		}
	}
	if len(refs) == 0 {
		return ""
	}
	sort.Strings(refs)
	return refs[s.rng.IntN(len(refs))]
}

func (s *soak) pickArchive() *archive {
	names := slices.Sorted(maps.Keys(s.archives))
	if len(names) == 0 {
		return nil
	}
	return s.archives[names[s.rng.IntN(len(names))]]
}

var extensions = []string{".tar", ".tar.gz", ".tar.zst", ".tar.lz4", ".tar.bz2"}

func (s *soak) addArchive() (string, error) {
	s.next++
	a := &archive{file: fmt.Sprintf("a%03d%s", s.next, extensions[s.rng.IntN(len(extensions))])}
	a.refs = map[string]string{}
	for i := range 1 + s.rng.IntN(2) {
		a.refs[fmt.Sprintf("soak.example/app%03d-%d:1.0", s.next, i)] = ""
	}
	s.archives[a.file] = a
	return a.file, s.writeArchive(a)
}

// writeArchive writes new images for a's references, to a temp file renamed into place (as an
// image copy tool would) so that the agent never reads a half-written archive.
func (s *soak) writeArchive(a *archive) error {
	tags := map[string]v1.Image{}
	for ref := range a.refs {
		img, err := imagetest.Image(int64(256<<10+s.rng.IntN(768<<10)), imagetest.Amd64)
		if err != nil {
			return err
		}
		id, err := img.ConfigName()
		if err != nil {
			return err
		}
		tags[ref], a.refs[ref] = img, id.String()
	}
	tmp := filepath.Join(s.dir, "tmp-"+a.file)
	if err := imagetest.WriteDocker(tmp, tags); err != nil {
		return err
	}
	a.damaged = false
	return os.Rename(tmp, filepath.Join(s.imagesDir, a.file))
}

// handImport imports ref (a fresh image) as `ctr images import` does: no pin.
func (s *soak) handImport(ref string) error {
	img, err := imagetest.Image(128<<10, imagetest.Amd64)
	if err != nil {
		return err
	}
	path := filepath.Join(s.dir, "hand.tar")
	if err := imagetest.WriteDocker(path, map[string]v1.Image{ref: img}); err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = s.client.Import(s.ctx, f, containerd.WithAllPlatforms(true))
	return err
}

// fill leaves less free space on containerd's root than one archive image needs.
func (s *soak) fill() (string, error) {
	var st syscall.Statfs_t
	root := filepath.Join(s.dir, "root")
	if err := syscall.Statfs(root, &st); err != nil {
		return "", err
	}
	leave := int64(128 << 10)
	size := int64(st.Bavail)*int64(st.Bsize) - leave
	if size <= 0 {
		return "containerd root (already full)", nil
	}
	s.filler = filepath.Join(root, "filler")
	f, err := os.Create(s.filler)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if err := syscall.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		return "", fmt.Errorf("fallocate %d MiB: %w", size>>20, err)
	}
	return fmt.Sprintf("containerd root (%d KiB left)", leave>>10), nil
}

func (s *soak) kubeletGC() (string, error) {
	manager, err := kubeletgc.NewManager(kubeletgc.NewCRIRuntime(s.client.Conn().(*grpc.ClientConn)),
		&kubeletgc.DiskUsage{Capacity: 1 << 30, UsedPercent: 95}, kubeletgc.Policy())
	if err != nil {
		return "", err
	}
	before, err := s.client.ImageService().List(s.ctx)
	if err != nil {
		return "", err
	}
	if err := manager.DeleteUnusedImages(s.ctx); err != nil && !strings.Contains(err.Error(), "wanted to free") {
		return "", err
	}
	after, err := s.client.ImageService().List(s.ctx)
	if err != nil {
		return "", err
	}
	removed := 0
	names := map[string]bool{}
	for _, img := range after {
		names[img.Name] = true
	}
	for _, img := range before {
		if !names[img.Name] && !strings.HasPrefix(img.Name, "sha256:") && !strings.Contains(img.Name, "@") {
			removed++
		}
	}
	s.res.GCRemoved += removed
	return fmt.Sprintf("%d tag(s) removed", removed), nil
}

// settle waits, up to the settle bound, for the invariant to hold, and returns the last
// violation if it never did.
func (s *soak) settle() (time.Duration, string) {
	start := time.Now()
	for {
		v := s.check()
		if v == "" || time.Since(start) > s.opts.Settle {
			return time.Since(start), v
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// check is the invariant, "" when it holds.
func (s *soak) check() string {
	ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
	defer cancel()
	all, err := s.client.ImageService().List(ctx)
	if err != nil {
		return "containerd: " + err.Error()
	}
	byName := map[string]images.Image{}
	for _, img := range all {
		byName[img.Name] = img
	}
	wanted := s.wanted()
	// While the disk is full, a wanted reference may be missing or still at an archive's previous
	// content, as long as the agent says why (in its state file, read once per check): a restore
	// waiting, or the archive failing for lack of space. The step that frees the disk then
	// requires everything back.
	var view statefile.RunStatus
	if s.full {
		if st, err := statefile.Load(s.state); err == nil {
			view = st.Agent
		}
	}
	noSpace := func(file string) bool { return s.full && strings.Contains(view.ArchiveErrors[file], "no space left") }
	archiveOf := map[string]string{}
	for _, a := range s.archives {
		for ref := range a.refs {
			archiveOf[ref] = a.file
		}
	}
	waiting := func(ref string) bool {
		return s.full && (slices.Contains(view.RestoresPending, ref) || noSpace(archiveOf[ref]))
	}
	cri := s.cri()
	wantedIDs := map[string]bool{} // repo + image ID of wanted references: digest refs of ours
	for _, ref := range slices.Sorted(maps.Keys(wanted)) {
		img, ok := byName[ref]
		if !ok {
			if waiting(ref) {
				continue
			}
			return ref + " is missing"
		}
		if !pinning.IsPinned(img.Labels) {
			return ref + " is not pinned"
		}
		status, err := cri.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
		if err != nil {
			return "CRI: " + err.Error()
		}
		if status.GetImage() == nil || !status.GetImage().Pinned {
			return ref + " is not pinned in the CRI's view"
		}
		if id := status.GetImage().Id; id != wanted[ref] && !waiting(ref) {
			return fmt.Sprintf("%s is image %s, want %s (its archive's current content)", ref, id, wanted[ref])
		}
	}
	for ref, id := range wanted {
		if named, err := reference.ParseNormalizedNamed(ref); err == nil {
			wantedIDs[named.Name()+" "+id] = true
		}
	}
	for _, img := range all {
		if _, ours := pinning.OwnPin(img.Labels); !ours {
			continue
		}
		if _, ok := wanted[img.Name]; ok {
			continue
		}
		// A digest reference (repo@manifest) is wanted when it is the image a wanted tag of the
		// same repository must be: same image ID.
		if named, err := reference.ParseNormalizedNamed(img.Name); err == nil {
			if config, err := img.Config(ctx, s.client.ContentStore(), platforms.Default()); err == nil && wantedIDs[named.Name()+" "+config.Digest.String()] {
				continue
			}
		}
		if src := img.Labels[pinning.LabelSource]; s.archives[src] != nil && noSpace(src) {
			continue // its archive's new content waits for disk: the old one is still what it provides
		}
		return fmt.Sprintf("%s carries our pin (source %s) but nothing wants it", img.Name, img.Labels[pinning.LabelSource])
	}
	user, ok := byName[userRef]
	if !ok || user.Labels[pinning.LabelPinned] != pinning.PinnedValue || user.Labels[pinning.LabelSource] != "" {
		return fmt.Sprintf("the user's pin on %s was touched: present=%t labels=%v", userRef, ok, user.Labels)
	}
	sandbox, ok := byName[sandboxRef]
	if !ok {
		return "the sandbox image is gone"
	}
	if _, ours := pinning.OwnPin(sandbox.Labels); ours {
		return "the sandbox image carries our pin"
	}
	return ""
}

// Print writes the summary.
func (r *Result) Print(w io.Writer) {
	fmt.Fprintf(w, "soak seed %d (containerd %s): %d rounds in %s, %d faults injected, %d steps with nothing to act on, %d images removed by the kubelet's DeleteUnusedImages, longest settle %s\n",
		r.Seed, r.Containerd, r.Rounds, r.Elapsed.Round(time.Second), r.total(), r.Skipped, r.GCRemoved, r.MaxSettle.Round(time.Millisecond))
	for _, f := range Faults {
		fmt.Fprintf(w, "  %-22s %d\n", f, r.Injected[f])
	}
	fmt.Fprintf(w, "invariant violations: %d\n", len(r.Violations))
	for _, v := range r.Violations {
		fmt.Fprintf(w, "  %s\n", v)
	}
}

func (r *Result) total() int {
	n := 0
	for _, c := range r.Injected {
		n += c
	}
	return n
}
