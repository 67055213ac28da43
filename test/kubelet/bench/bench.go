// Package bench is `make bench`: every cost k3s-pinning adds to a node, each measured against a
// baseline in the same run on a real containerd (these machines are shared and noisy: only
// ratios compare across runs). Row by row:
//
//  1. cold start: the agent's import+pin of an images dir vs `ctr images import --no-unpack
//     --all-platforms` of the same archives (the same work: content and image records, no unpack;
//     k3s does not unpack at import either), for the 1 GiB set and for 100 archives of 10 images;
//     beside each, its floor: the blobs and records the load left, written again onto a fresh
//     containerd from memory (containerdtest.Load), which no importer through containerd's API
//     beats by much;
//  2. warm restart with unchanged archives vs that cold import; and at 1,000 and 10,000
//     references (best of three restarts, the first shown beside), against 0.1 s per 1,000;
//  3. restore: CRI RemoveImage to the image back, vs `ctr images import` of its archive alone;
//  4. the keep-decision inside the kubelet's real GC cycle over 5,000 and 50,000 images: with the
//     filter vs without;
//  5. idle CPU of `k3s-pinning run` over a quiet minute with 1,000 wanted references, and its
//     resident memory with 1,000 and 10,000;
//  6. pin throughput on a 1,000-image store vs containerd's images.Update, one at a time.
package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	cimages "github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/klog/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
	"github.com/k3s-pinning/k3s-pinning/test/kubelet/kubeletgc"
)

// Options size the run.
type Options struct {
	LargeImages  int           // images of the large set, one archive each
	LargeTotal   int64         // their total size in bytes
	SmallImages  int           // images of the small set, 10 per archive
	GCImages     int           // images the kubelet's GC cycle lists, on the small set
	HugeImages   int           // references of the huge set (10 per archive); 0 leaves it out
	HugeGCImages int           // images the kubelet's GC cycle lists, on the huge set; 0: no cycle
	Idle         time.Duration // how long `k3s-pinning run` is watched doing nothing
	Rounds       int           // rounds of the cold-start comparison; the best of each side counts
}

// Defaults are the sizes the issue names.
var Defaults = Options{LargeImages: 20, LargeTotal: 1 << 30, SmallImages: 1000, GCImages: 5000, HugeImages: 10000, HugeGCImages: 50000, Idle: time.Minute, Rounds: 2}

// Row is one line of the table.
type Row struct {
	Figure, Value, Baseline string
	Ratio                   float64 // 0: no ratio for this row
	Target                  string
	Met                     string // "yes", "NO", or "-" when the row has no target
}

type bench struct {
	opts Options
	log  io.Writer
	work string
	rows []Row
}

// Run runs every row in a temp dir under work and removes it on return.
func Run(ctx context.Context, opts Options, log io.Writer) ([]Row, error) {
	work, err := os.MkdirTemp("", "k3s-pinning-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	b := &bench{opts: opts, log: log, work: work}
	ctx = namespaces.WithNamespace(ctx, pinning.DefaultNamespace)
	klog.LogToStderr(false)
	klog.SetOutput(io.Discard)
	defer klog.LogToStderr(true)
	if err := b.large(ctx); err != nil {
		return b.rows, err
	}
	if err := b.small(ctx); err != nil {
		return b.rows, err
	}
	return b.rows, nil
}

// daemon starts a fresh containerd in a dir of its own.
func (b *bench) daemon(ctx context.Context, name string) (*containerdtest.Daemon, *containerd.Client, func(), error) {
	return b.daemonOf(ctx, name, "")
}

// daemonOf starts a fresh containerd of the line l ("" or one of containerdtest.Matrix).
func (b *bench) daemonOf(ctx context.Context, name, l string) (*containerdtest.Daemon, *containerd.Client, func(), error) {
	dir := filepath.Join(b.work, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, nil, nil, err
	}
	d, err := containerdtest.Start(ctx, dir, containerdtest.Options{Line: l})
	if err != nil {
		return nil, nil, nil, err
	}
	c, err := d.Client()
	if err != nil {
		d.Stop()
		return nil, nil, nil, err
	}
	stop := func() { c.Close(); d.Stop(); containerdtest.UnmountUnder(dir); os.RemoveAll(dir) }
	return d, c, stop, nil
}

// largeFormats are the endings `ctr images import` reads itself, so that the baseline is ctr alone.
var largeFormats = []struct {
	ext string
	oci bool
}{{".tar", false}, {".tar.gz", true}, {".tar.zst", false}, {".tar", true}, {".tar.gz", false}, {".tar.zst", true}}

func (b *bench) large(ctx context.Context) error {
	dir := filepath.Join(b.work, "large-images")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	size := b.opts.LargeTotal / int64(b.opts.LargeImages)
	fmt.Fprintf(b.log, "== writing %d archives of one %d MiB image each\n", b.opts.LargeImages, size>>20)
	var archives, refs []string
	for i := range b.opts.LargeImages {
		f := largeFormats[i%len(largeFormats)]
		kind := "docker"
		if f.oci {
			kind = "oci"
		}
		path := filepath.Join(dir, fmt.Sprintf("%02d-%s%s", i, kind, f.ext))
		ref := fmt.Sprintf("bench.example/large/img%02d:1.0", i)
		img, err := imagetest.Image(size, imagetest.Amd64)
		if err != nil {
			return err
		}
		if f.oci {
			err = imagetest.WriteOCI(path, map[string]any{ref: img})
		} else {
			err = imagetest.WriteDocker(path, map[string]v1.Image{ref: img})
		}
		if err != nil {
			return err
		}
		archives, refs = append(archives, path), append(refs, ref)
	}

	var ctrBest, oursBest time.Duration
	var stopOurs func()
	var oursClient *containerd.Client
	stateFile := filepath.Join(b.work, "large-state.json")
	for round := range b.opts.Rounds {
		d, _, stop, err := b.daemon(ctx, fmt.Sprintf("ctr%d", round))
		if err != nil {
			return err
		}
		start := time.Now()
		for _, a := range archives {
			if out, err := exec.CommandContext(ctx, d.Bin.Ctr, "-a", d.Address, "-n", pinning.DefaultNamespace, "images", "import", "--no-unpack", "--all-platforms", a).CombinedOutput(); err != nil {
				stop()
				return fmt.Errorf("ctr images import %s: %v\n%s", a, err, out)
			}
		}
		took := time.Since(start)
		stop()
		if ctrBest == 0 || took < ctrBest {
			ctrBest = took
		}
		fmt.Fprintf(b.log, "   round %d: ctr images import %s\n", round+1, took.Round(time.Millisecond))

		_, c, stop, err := b.daemon(ctx, fmt.Sprintf("ours%d", round))
		if err != nil {
			return err
		}
		os.Remove(stateFile)
		start = time.Now()
		rep := images.NewAgent(images.Services(c), images.Config{ImagesDir: dir, StateFile: stateFile}).Sync(ctx)
		took = time.Since(start)
		if err := rep.Err(); err != nil {
			stop()
			return err
		}
		fmt.Fprintf(b.log, "   round %d: k3s-pinning sync %s\n", round+1, took.Round(time.Millisecond))
		if oursBest == 0 || took < oursBest {
			oursBest = took
		}
		if stopOurs != nil {
			stopOurs()
		}
		stopOurs, oursClient = stop, c
	}
	defer stopOurs()
	b.add(Row{Figure: fmt.Sprintf("cold start: import+pin of %d archives, %d MiB", len(archives), b.opts.LargeTotal>>20),
		Value: secs(oursBest), Baseline: secs(ctrBest) + " ctr images import", Ratio: ratio(oursBest, ctrBest), Target: "<= 0.35"})
	if err := b.floorRow(ctx, oursClient, "large", oursBest, ctrBest); err != nil {
		return err
	}

	// 2. Warm restart: a new agent on the state the cold start wrote; nothing changed.
	start := time.Now()
	rep := images.NewAgent(images.Services(oursClient), images.Config{ImagesDir: dir, StateFile: stateFile}).Sync(ctx)
	warm := time.Since(start)
	if err := rep.Err(); err != nil {
		return err
	}
	for _, a := range rep.Archives {
		if a.Imported {
			return fmt.Errorf("warm restart imported %s again", a.Archive.Name())
		}
	}
	b.add(Row{Figure: fmt.Sprintf("warm restart, %d unchanged archives", len(archives)), Value: secs(warm),
		Baseline: secs(ctrBest) + " cold import", Ratio: ratio(warm, ctrBest), Target: "<= 0.02"})

	// 3. Restore: the running agent brings back an image removed through the CRI.
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	agent := images.NewAgent(images.Services(oursClient), images.Config{ImagesDir: dir, StateFile: stateFile})
	done := make(chan error, 1)
	go func() { done <- agent.Run(runCtx, images.RunOptions{Restore: true, ReconcileInterval: time.Hour}) }()
	defer func() { cancel(); <-done }()
	time.Sleep(2 * time.Second) // its first sync: everything unchanged
	cri := runtimeapi.NewImageServiceClient(oursClient.Conn().(*grpc.ClientConn))
	// one archive of each of the first kinds: docker .tar, OCI .tar.gz, docker .tar.zst
	restored := []int{0, 1, 2}[:min(3, len(archives))]
	var restores []time.Duration
	for _, i := range restored {
		start := time.Now()
		if _, err := cri.RemoveImage(ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: refs[i]}}); err != nil {
			return err
		}
		for {
			if _, err := oursClient.ImageService().Get(ctx, refs[i]); err == nil {
				break
			}
			if time.Since(start) > time.Minute {
				return fmt.Errorf("%s not restored within a minute", refs[i])
			}
			time.Sleep(5 * time.Millisecond)
		}
		restores = append(restores, time.Since(start))
	}
	var alone []time.Duration
	for _, i := range restored {
		d, _, stop, err := b.daemon(ctx, fmt.Sprintf("alone%d", i))
		if err != nil {
			return err
		}
		start := time.Now()
		out, err := exec.CommandContext(ctx, d.Bin.Ctr, "-a", d.Address, "-n", pinning.DefaultNamespace, "images", "import", "--no-unpack", "--all-platforms", archives[i]).CombinedOutput()
		alone = append(alone, time.Since(start))
		stop()
		if err != nil {
			return fmt.Errorf("ctr images import %s: %v\n%s", archives[i], err, out)
		}
	}
	for k, i := range restored {
		target := time.Duration(1.2*float64(alone[k])) + time.Second
		b.add(Row{Figure: "restore after CRI RemoveImage: " + filepath.Base(archives[i]), Value: secs(restores[k]),
			Baseline: secs(alone[k]) + " import alone", Ratio: ratio(restores[k], alone[k]),
			Target: "<= 1.2x + 1 s (" + secs(target) + ")", Met: yes(restores[k] <= target)})
	}
	return nil
}

// refSet is an images dir of archives of 10 small images each, synced into a containerd of its
// own: once cold, then by a new agent on the state the first wrote (a warm restart).
type refSet struct {
	dir, state string
	refs       []string
	archives   []string
	d          *containerdtest.Daemon
	c          *containerd.Client
	agent      *images.Agent // the last warm one: its Keeper is the GC filter
	cold       time.Duration
	warm       time.Duration // the best of warmRounds restarts
	warmFirst  time.Duration // the first, right after the cold sync
}

// warmRounds is how many warm restarts a reference set takes: each a new agent on the state the
// cold sync wrote, the same work; the best is the figure, as the cold rows take the best of their
// rounds (the first one meets containerd still settling from the cold import).
const warmRounds = 3

func (b *bench) refSet(ctx context.Context, name string, refCount int) (*refSet, func(), error) {
	return b.refSetOn(ctx, name, refCount, "")
}

// refSetOn is refSet on a containerd of the line l.
func (b *bench) refSetOn(ctx context.Context, name string, refCount int, l string) (*refSet, func(), error) {
	s := &refSet{dir: filepath.Join(b.work, name+"-images"), state: filepath.Join(b.work, name+"-state.json")}
	if err := os.MkdirAll(s.dir, 0o755); err != nil {
		return nil, nil, err
	}
	perArchive := 10
	count := refCount / perArchive
	fmt.Fprintf(b.log, "== writing %d archives of %d small images\n", count, perArchive)
	for a := range count {
		tags := map[string]v1.Image{}
		for i := range perArchive {
			img, err := imagetest.Image(4<<10, imagetest.Amd64)
			if err != nil {
				return nil, nil, err
			}
			ref := fmt.Sprintf("bench.example/%s/a%04d-img%d:1.0", name, a, i)
			tags[ref], s.refs = img, append(s.refs, ref)
		}
		path := filepath.Join(s.dir, fmt.Sprintf("%s-%04d.tar", name, a))
		if err := imagetest.WriteDocker(path, tags); err != nil {
			return nil, nil, err
		}
		s.archives = append(s.archives, path)
	}
	d, c, stop, err := b.daemonOf(ctx, name, l)
	if err != nil {
		return nil, nil, err
	}
	s.d, s.c = d, c
	start := time.Now()
	if err := images.NewAgent(images.Services(c), images.Config{ImagesDir: s.dir, StateFile: s.state}).Sync(ctx).Err(); err != nil {
		stop()
		return nil, nil, err
	}
	s.cold = time.Since(start)
	fmt.Fprintf(b.log, "   cold sync of %d references: %s\n", len(s.refs), s.cold.Round(time.Millisecond))
	for round := range warmRounds {
		s.agent = images.NewAgent(images.Services(c), images.Config{ImagesDir: s.dir, StateFile: s.state})
		start = time.Now()
		rep := s.agent.Sync(ctx)
		took := time.Since(start)
		if err := rep.Err(); err != nil {
			stop()
			return nil, nil, err
		}
		for _, a := range rep.Archives {
			if a.Imported {
				stop()
				return nil, nil, fmt.Errorf("warm restart imported %s again", a.Archive.Name())
			}
		}
		if round == 0 {
			s.warmFirst = took
		}
		if round == 0 || took < s.warm {
			s.warm = took
		}
	}
	return s, stop, nil
}

// warmRow is the warm restart of s, against the target of 0.1 s per 1,000 references.
func (b *bench) warmRow(s *refSet) {
	per1000 := s.warm * 1000 / time.Duration(len(s.refs))
	b.add(Row{Figure: fmt.Sprintf("warm restart, %d references (%d archives), containerd %s", len(s.refs), len(s.archives), s.d.Bin.Version),
		Value:    fmt.Sprintf("%s (%s per 1,000; first %s)", secs(s.warm), secs(per1000), secs(s.warmFirst)),
		Baseline: secs(s.cold) + " cold sync", Ratio: ratio(s.warm, s.cold),
		Target: "<= 0.100 s per 1,000", Met: yes(per1000 <= 100*time.Millisecond)})
}

func (b *bench) small(ctx context.Context) error {
	set, stop, err := b.refSet(ctx, "small", b.opts.SmallImages)
	if err != nil {
		return err
	}
	defer stop()
	b.warmRow(set)
	if err := b.coldSmall(ctx, set); err != nil {
		return err
	}
	if err := b.gcCycle(ctx, set, b.opts.GCImages, 30); err != nil {
		return err
	}
	if err := b.agentProcess(ctx, set, true); err != nil {
		return err
	}
	if err := b.pinThroughput(ctx, set.c, set.refs); err != nil {
		return err
	}
	stop()

	// The same warm restart on each older containerd line k3s ships.
	for _, l := range containerdtest.Matrix {
		set, stop, err := b.refSetOn(ctx, "small-"+l, b.opts.SmallImages, l)
		if err != nil {
			return fmt.Errorf("containerd %s: %w", l, err)
		}
		b.warmRow(set)
		stop()
	}

	if b.opts.HugeImages <= 0 {
		return nil
	}
	huge, stop, err := b.refSet(ctx, "huge", b.opts.HugeImages)
	if err != nil {
		return err
	}
	defer stop()
	b.warmRow(huge)
	if err := b.agentProcess(ctx, huge, false); err != nil {
		return err
	}
	if b.opts.HugeGCImages > 0 {
		return b.gcCycle(ctx, huge, b.opts.HugeGCImages, 10)
	}
	return nil
}

// coldSmall compares the cold sync of the small set with `ctr images import` of its archives.
func (b *bench) coldSmall(ctx context.Context, s *refSet) error {
	d, _, stop, err := b.daemon(ctx, "small-ctr")
	if err != nil {
		return err
	}
	defer stop()
	start := time.Now()
	for _, a := range s.archives {
		if out, err := exec.CommandContext(ctx, d.Bin.Ctr, "-a", d.Address, "-n", pinning.DefaultNamespace, "images", "import", "--no-unpack", "--all-platforms", a).CombinedOutput(); err != nil {
			return fmt.Errorf("ctr images import %s: %v\n%s", a, err, out)
		}
	}
	ctr := time.Since(start)
	b.add(Row{Figure: fmt.Sprintf("cold start: import+pin of %d archives of 10 small images", len(s.archives)),
		Value: secs(s.cold), Baseline: secs(ctr) + " ctr images import", Ratio: ratio(s.cold, ctr), Target: "<= 0.35"})
	return b.floorRow(ctx, s.c, "small", s.cold, ctr)
}

// floorRow measures the floor of the cold start just measured (ours, against ctr's): what our
// load left in c (every blob with its labels, every image record) written again onto a fresh
// containerd from memory, as many writes in flight as the load had (an archive per core) and four
// times that, the best of both in every round (on 2 cores, 1 in flight was slower, 32 no faster).
// Nothing is read from an archive and nothing hashed on the writer's side: a load that leaves the
// same records through containerd's API takes about this long at least, so a target below it is
// one no importer meets on that containerd.
func (b *bench) floorRow(ctx context.Context, c *containerd.Client, name string, ours, ctr time.Duration) error {
	load, err := containerdtest.ReadLoad(ctx, c.ContentStore(), c.ImageService())
	if err != nil {
		return fmt.Errorf("reading what the cold start left: %w", err)
	}
	var best time.Duration
	for round := range b.opts.Rounds {
		for _, inFlight := range []int{runtime.GOMAXPROCS(0), 4 * runtime.GOMAXPROCS(0)} {
			_, fc, stop, err := b.daemon(ctx, fmt.Sprintf("%s-floor%d-%d", name, round, inFlight))
			if err != nil {
				return err
			}
			start := time.Now()
			err = load.Write(ctx, fc.ContentStore(), fc.ImageService(), fc.LeasesService(), inFlight)
			took := time.Since(start)
			stop()
			if err != nil {
				return fmt.Errorf("the floor of the %s set's cold start: %w", name, err)
			}
			fmt.Fprintf(b.log, "   round %d: its floor (%d blobs, %d MiB, %d image records from memory, %d in flight) %s\n",
				round+1, len(load.Blobs), load.Bytes()>>20, len(load.Images), inFlight, took.Round(time.Millisecond))
			if best == 0 || took < best {
				best = took
			}
		}
	}
	b.add(Row{Figure: fmt.Sprintf("  its floor: the %d blobs and %d image records it left, written again from memory (nothing read or hashed by the writer)", len(load.Blobs), len(load.Images)),
		Value: fmt.Sprintf("%s (the load %.2fx it)", secs(best), ratio(ours, best)), Baseline: secs(ctr) + " ctr images import", Ratio: ratio(best, ctr), Target: "-"})
	return nil
}

// gcCycle times the kubelet's real GC cycle (GarbageCollect below the threshold: detection and
// ordering of every image, nothing to delete) over total images, with the filter of s's agent and
// without, rounds cycles of each kind.
func (b *bench) gcCycle(ctx context.Context, s *refSet, total, rounds int) error {
	c := s.c
	extra := total - len(s.refs)
	fmt.Fprintf(b.log, "== creating %d more images for the kubelet's GC cycle\n", extra)
	if err := createImages(ctx, c, extra); err != nil {
		return err
	}

	conn := c.Conn().(*grpc.ClientConn)
	cri := runtimeapi.NewImageServiceClient(conn)
	// The CRI labels each created image and makes its ID record from containerd's events, two
	// writes each, behind the creates: it can take minutes to list every one.
	for deadline := time.Now().Add(10 * time.Minute); ; {
		resp, err := cri.ListImages(ctx, &runtimeapi.ListImagesRequest{})
		if err == nil && len(resp.Images) >= total {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the CRI lists %d images, want %d (%v); missing: %v", len(resp.GetImages()), total, err, missingFromCRI(ctx, c, resp.GetImages()))
		}
		time.Sleep(500 * time.Millisecond)
	}
	manager, err := kubeletgc.NewManager(kubeletgc.NewCRIRuntime(conn), &kubeletgc.DiskUsage{Capacity: 1 << 40, UsedPercent: 50}, kubeletgc.Policy())
	if err != nil {
		return err
	}
	// Cycles on a shared VM: alternating, compared by median.
	var with, without []time.Duration
	for i := range 2*rounds + 2 {
		filtered := i%2 == 1
		var unregister func()
		if filtered {
			unregister = kubeletgc.RegisterFilter(s.agent.Keeper())
		}
		start := time.Now()
		err := manager.GarbageCollect(ctx, start)
		took := time.Since(start)
		if unregister != nil {
			unregister()
		}
		if err != nil {
			return err
		}
		if i < 2 {
			continue // the first cycle of each kind fills the GC's records and our memo
		}
		if filtered {
			with = append(with, took)
		} else {
			without = append(without, took)
		}
	}
	mw, mo := median(with), median(without)
	b.add(Row{Figure: fmt.Sprintf("kubelet GC cycle, %d images, filter registered", total), Value: secs(mw),
		Baseline: secs(mo) + " without filter", Ratio: ratio(mw, mo), Target: "<= 1.05"})
	return nil
}

// missingFromCRI names the first images of the store that the CRI does not list.
func missingFromCRI(ctx context.Context, c *containerd.Client, listed []*runtimeapi.Image) []string {
	tags := map[string]bool{}
	for _, img := range listed {
		for _, t := range img.RepoTags {
			tags[t] = true
		}
	}
	all, err := c.ImageService().List(ctx)
	if err != nil { // one answer holds every record: past gRPC's 16 MiB, about 37,000 of the bench's (the GC row's store holds three times that)
		return []string{fmt.Sprintf("(the store not listed: %v)", err)}
	}
	var missing []string
	for _, img := range all {
		if !strings.HasPrefix(img.Name, "sha256:") && !strings.Contains(img.Name, "@") && !tags[img.Name] && len(missing) < 5 {
			missing = append(missing, img.Name)
		}
	}
	return missing
}

// createImages adds n distinct images (own config, one shared empty layer) straight to the store.
func createImages(ctx context.Context, c *containerd.Client, n int) error {
	// a lease keeps the blobs from containerd's GC until the images reference them
	ctx, done, err := c.WithLease(ctx)
	if err != nil {
		return err
	}
	defer done(ctx)
	cs := c.ContentStore()
	layer := []byte{}
	layerDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: digest.FromBytes(layer), Size: 0}
	if err := content.WriteBlob(ctx, cs, "bench-layer", bytes.NewReader(layer), layerDesc); err != nil {
		return err
	}
	for i := range n {
		cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
			RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{layerDesc.Digest}},
			Config: ocispec.ImageConfig{Labels: map[string]string{"bench": strconv.Itoa(i)}}})
		cfgDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(cfg), Size: int64(len(cfg))}
		man, _ := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, Config: cfgDesc, Layers: []ocispec.Descriptor{layerDesc}})
		manDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(man), Size: int64(len(man))}
		labels := map[string]string{"containerd.io/gc.ref.content.config": cfgDesc.Digest.String(), "containerd.io/gc.ref.content.l.0": layerDesc.Digest.String()}
		if err := content.WriteBlob(ctx, cs, "bench-config", bytes.NewReader(cfg), cfgDesc); err != nil {
			return err
		}
		if err := content.WriteBlob(ctx, cs, "bench-manifest", bytes.NewReader(man), manDesc, content.WithLabels(labels)); err != nil {
			return err
		}
		if _, err := c.ImageService().Create(ctx, cimages.Image{Name: fmt.Sprintf("bench.example/gc/img%05d:1.0", i), Target: manDesc}); err != nil {
			return err
		}
	}
	return nil
}

// agentProcess runs the built `k3s-pinning run` on s (its references already loaded: what a
// restart finds), waits for its first sync, then reads its resident memory and, with idle, its
// CPU time over a quiet period.
func (b *bench) agentProcess(ctx context.Context, s *refSet, idle bool) error {
	bin := filepath.Join(b.work, "k3s-pinning")
	if _, err := os.Stat(bin); err != nil {
		root, err := containerdtest.ModuleRoot()
		if err != nil {
			return err
		}
		// Built as make release builds it (scripts/release.sh: CGO off, -trimpath, -s -w): the
		// binary a node runs. Its pages are part of the resident size: a default build links
		// libc and maps more of them at the same work.
		build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, "./cmd/k3s-pinning")
		build.Dir, build.Env = root, append(os.Environ(), "GOWORK=off", "GOFLAGS=", "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			return fmt.Errorf("build k3s-pinning: %v\n%s", err, out)
		}
	}
	state := filepath.Join(b.work, "process-state.json")
	os.Remove(state)
	cmd := exec.CommandContext(ctx, bin, "run", "--containerd-address", s.d.Address, "--images-dir", s.dir, "--state-file", state, "--restore")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	defer containerdtest.Terminate(cmd.Process, exited, 10*time.Second)
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
		if _, err := os.Stat(state); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("k3s-pinning run wrote no state within 5 minutes")
		}
	}
	time.Sleep(3 * time.Second) // let the first sync's work and the GC of its garbage finish
	if idle {
		fmt.Fprintf(b.log, "== watching k3s-pinning run (pid %d) for %s\n", cmd.Process.Pid, b.opts.Idle)
		cpu0, err := cpuSeconds(cmd.Process.Pid)
		if err != nil {
			return err
		}
		time.Sleep(b.opts.Idle)
		cpu1, err := cpuSeconds(cmd.Process.Pid)
		if err != nil {
			return err
		}
		b.add(Row{Figure: fmt.Sprintf("idle CPU of `k3s-pinning run` over %s", b.opts.Idle), Value: fmt.Sprintf("%.2f s", cpu1-cpu0),
			Baseline: "-", Target: "< 0.05 s", Met: yes(cpu1-cpu0 < 0.05)})
	}
	mem, err := containerdtest.ProcessMemory(cmd.Process.Pid)
	if err != nil {
		return err
	}
	// The binary's own pages are part of the resident size, the same at 0 references as at
	// 10,000: given beside it, what the references cost is the rest.
	b.add(Row{Figure: fmt.Sprintf("resident memory of `k3s-pinning run`, %d wanted references", len(s.refs)), Value: fmt.Sprintf("%.1f MiB (peak %.1f; the binary's pages %.1f)", mem.RSS, mem.HWM, mem.File),
		Baseline: "-", Target: "<= 48 MiB, peak <= 64", Met: yes(mem.RSS <= 48 && mem.HWM <= 64)})
	return nil
}

// pinThroughput pins every reference of the small set again after stripping every pin, as the
// agent does (PinWanted over one list of the store, its writes pipelined), and compares with
// the bare images.Update that sets the same label, one at a time.
func (b *bench) pinThroughput(ctx context.Context, c *containerd.Client, refs []string) error {
	store := c.ImageService()
	pinner := pinning.NewPinner(store)
	if err := containerdtest.StripPins(ctx, store); err != nil {
		return err
	}
	wanted := map[string]bool{}
	for _, ref := range refs {
		wanted[ref] = true
	}
	start := time.Now()
	listed, err := store.List(ctx)
	if err != nil {
		return err
	}
	pinned, err := pinner.PinWanted(ctx, slices.Values(listed), func(img cimages.Image) (string, bool) { return "bench", wanted[img.Name] })
	ours := time.Since(start)
	if err != nil {
		return err
	}
	if len(pinned) != len(refs) {
		return fmt.Errorf("PinWanted pinned %d of %d references", len(pinned), len(refs))
	}
	if err := containerdtest.StripPins(ctx, store); err != nil {
		return err
	}
	start = time.Now()
	for _, ref := range refs {
		img := cimages.Image{Name: ref, Labels: map[string]string{pinning.LabelPinned: pinning.PinnedValue}}
		if _, err := store.Update(ctx, img, "labels."+pinning.LabelPinned); err != nil {
			return err
		}
	}
	bare := time.Since(start)
	perSec := func(d time.Duration) string { return fmt.Sprintf("%.0f refs/s", float64(len(refs))/d.Seconds()) }
	b.add(Row{Figure: fmt.Sprintf("pin throughput, %d references", len(refs)), Value: perSec(ours),
		Baseline: perSec(bare) + " one images.Update at a time", Ratio: ratio(ours, bare), Target: "-"})
	return nil
}

func (b *bench) add(r Row) {
	if r.Met == "" {
		r.Met = "-"
		if strings.HasPrefix(r.Target, "<= ") {
			if limit, err := strconv.ParseFloat(strings.TrimPrefix(r.Target, "<= "), 64); err == nil {
				r.Met = yes(r.Ratio <= limit)
			}
		}
	}
	b.rows = append(b.rows, r)
	fmt.Fprintf(b.log, "   %s: %s (baseline %s)\n", r.Figure, r.Value, r.Baseline)
}

// Print writes the table; the ratio is time over baseline time.
func Print(w io.Writer, rows []Row) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FIGURE\tVALUE\tBASELINE\tRATIO\tTARGET\tMET")
	for _, r := range rows {
		ratio := "-"
		if r.Ratio > 0 {
			ratio = fmt.Sprintf("%.3f", r.Ratio)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", r.Figure, r.Value, r.Baseline, ratio, r.Target, r.Met)
	}
	tw.Flush()
}

func secs(d time.Duration) string { return fmt.Sprintf("%.3f s", d.Seconds()) }

func ratio(a, b time.Duration) float64 { return float64(a) / float64(b) }

func yes(ok bool) string {
	if ok {
		return "yes"
	}
	return "NO"
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// cpuSeconds is the user+system CPU time of pid, from /proc (clock ticks of 1/100 s). A process
// that has exited (a zombie) or a line it cannot read is an error, never 0 s.
func cpuSeconds(pid int) (float64, error) {
	fields, err := containerdtest.ProcessStat(pid)
	if err != nil {
		return 0, err
	}
	if fields[0] == "Z" || fields[0] == "X" {
		return 0, fmt.Errorf("process %d has exited (state %s)", pid, fields[0])
	}
	utime, err := strconv.ParseFloat(fields[11], 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/%d/stat utime: %w", pid, err)
	}
	stime, err := strconv.ParseFloat(fields[12], 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/%d/stat stime: %w", pid, err)
	}
	return (utime + stime) / 100, nil
}
