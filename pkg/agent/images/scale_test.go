package images_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	containerdimages "github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/platforms"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// callCounter counts the gRPC calls a containerd client makes, by method.
type callCounter struct {
	mu    sync.Mutex
	calls map[string]int
}

func (c *callCounter) count(method string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls[method]++
}

func (c *callCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = map[string]int{}
}

func (c *callCounter) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.calls)
}

func (c *callCounter) dialOpts() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			c.count(method)
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			c.count(method)
			return streamer(ctx, desc, cc, method, opts...)
		}),
	}
}

// scaleImagesDir is an images dir of archives archives of 3 images each, under registry; oci
// says which are OCI archives (the others are docker archives). It returns the dir and every tag.
func scaleImagesDir(t *testing.T, registry string, archives int, oci func(i int) bool) (string, []string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "images")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	var all []string
	for i := range archives {
		var refs []string
		for j := range 3 {
			refs = append(refs, fmt.Sprintf("%s/n%d/a%02d-img%d:1.0", registry, archives, i, j))
		}
		writeArchive(t, dir, archiveCase{file: fmt.Sprintf("a%02d.tar", i), oci: oci(i), refs: refs})
		all = append(all, refs...)
	}
	return dir, all
}

// TestColdLoadReadsNothingBack: a cold load makes, per blob, its write and, per record, its
// create, and reads nothing back from containerd: containerd's import of a docker archive reads
// each image's manifest and config and the start of each layer (its compression) back from the
// store, and checking each image complete opened its config and layers, eight calls per image
// (800 for 100 small images), answered here from what the import's writers kept. The images are
// complete all the same, by containerd's own check against its store.
func TestColdLoadReadsNothingBack(t *testing.T) {
	n := newNode(t)
	dir, refs := scaleImagesDir(t, "reads.example", 4, func(i int) bool { return i%2 == 1 })
	counter := &callCounter{calls: map[string]int{}}
	client, err := containerd.New(n.daemon.Address, containerd.WithExtraDialOpts(counter.dialOpts()))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if err := images.NewAgent(images.Services(client), images.Config{ImagesDir: dir, StateFile: filepath.Join(t.TempDir(), "state.json")}).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	calls := counter.snapshot()
	for _, method := range []string{"/containerd.services.content.v1.Content/Read", "/containerd.services.content.v1.Content/Info", "/containerd.services.images.v1.Images/Get"} {
		if calls[method] != 0 {
			t.Errorf("a cold load of %d images made %d calls of %s, want none", len(refs), calls[method], method)
		}
	}
	for _, ref := range refs {
		img, err := n.client.ImageService().Get(n.ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		available, _, _, missing, err := containerdimages.Check(n.ctx, n.client.ContentStore(), img.Target, platforms.Default())
		if err != nil || !available || len(missing) > 0 {
			t.Errorf("%s: available %t, missing %v (%v)", ref, available, missing, err)
		}
	}
}

// TestWarmRestartCallsDoNotGrowWithReferences: a restart with unchanged archives verifies every
// reference (present, its content there, pinned) from one list of the image store and one of the
// content store. The calls it makes to containerd are the same for 2 archives as for 12: one call
// per reference made a node with 10,000 references wait 20 s before its kubelet could start. So
// are those of a first start on a store that holds the images already (no state file).
func TestWarmRestartCallsDoNotGrowWithReferences(t *testing.T) {
	n := newNode(t)
	warmCalls := func(archives int) (warm, first map[string]int) {
		t.Helper()
		dir, _ := scaleImagesDir(t, "scale.example", archives, func(i int) bool { return i%2 == 1 })
		cfg := images.Config{ImagesDir: dir, StateFile: filepath.Join(t.TempDir(), "state.json"), ExtraRegistries: []string{"mirror.example"}}
		counter := &callCounter{calls: map[string]int{}}
		client, err := containerd.New(n.daemon.Address, containerd.WithExtraDialOpts(counter.dialOpts()))
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		if err := images.NewAgent(images.Services(client), cfg).Sync(n.ctx).Err(); err != nil {
			t.Fatalf("cold sync of %d archives: %v", archives, err)
		}
		// containerd's import of a docker archive asks the content store for compressed copies of
		// each image's layers, a walk of the whole store each time; the sync answers from its one.
		if cold := counter.snapshot()["/containerd.services.content.v1.Content/List"]; cold != 1 {
			t.Errorf("the cold sync of %d archives (%d docker-format images) walked the content store %d times, want 1", archives, archives/2*3+archives%2*3, cold)
		}
		counter.reset()
		report := images.NewAgent(images.Services(client), cfg).Sync(n.ctx)
		if err := report.Err(); err != nil {
			t.Fatalf("warm sync of %d archives: %v", archives, err)
		}
		verified := 0
		for _, a := range report.Archives {
			for _, r := range a.Refs {
				verified++
				if a.Imported || r.Result != pinning.AlreadyOurs {
					t.Errorf("warm sync: %s: imported=%t, %s %s", a.Archive.Name(), a.Imported, r.Ref, r.Result)
				}
			}
		}
		if want := archives * 3 * 4; verified != want { // each tag and its repo@digest, also under mirror.example
			t.Errorf("warm sync of %d archives verified %d references, want %d", archives, verified, want)
		}
		warm = counter.snapshot()
		// The daemon's first start on this store (no state file): a docker archive's image is
		// known by the CRI's sha256:<image ID> record beside it, not by reading its manifest.
		n.await(10*time.Second, "the CRI's image ID records", func() bool {
			all, err := n.client.ImageService().List(n.ctx)
			tags, ids := 0, 0
			for _, img := range all {
				switch {
				case strings.HasPrefix(img.Name, "sha256:"):
					ids++
				case strings.HasPrefix(img.Name, "scale.example/") && !strings.Contains(img.Name, "@"):
					tags++
				}
			}
			return err == nil && ids >= tags
		})
		counter.reset()
		fresh := images.NewAgent(images.Services(client), images.Config{ImagesDir: dir, StateFile: filepath.Join(t.TempDir(), "first.json"), ExtraRegistries: cfg.ExtraRegistries}).Sync(n.ctx)
		if err := fresh.Err(); err != nil {
			t.Fatalf("first start on %d archives: %v", archives, err)
		}
		for _, a := range fresh.Archives {
			if a.Imported {
				t.Errorf("first start on a store that holds them: %s imported again", a.Archive.Name())
			}
		}
		return warm, counter.snapshot()
	}
	few, fewFirst := warmCalls(2)
	many, manyFirst := warmCalls(12)
	if !maps.Equal(few, many) {
		t.Errorf("calls to containerd grow with the references:\n  2 archives:  %v\n  12 archives: %v", few, many)
	}
	if !maps.Equal(fewFirst, manyFirst) {
		t.Errorf("calls of a first start without a state file grow with the references:\n  2 archives:  %v\n  12 archives: %v", fewFirst, manyFirst)
	}
	// One list of each store: the image list serves the verification, the pins the plan lacks
	// and the kubelet's filter; the content list, that the verified references' content is there.
	for _, method := range []string{"/containerd.services.images.v1.Images/List", "/containerd.services.content.v1.Content/List"} {
		if many[method] != 1 {
			t.Errorf("a warm sync called %s %d times, want 1", method, many[method])
		}
	}
	t.Logf("calls of a warm sync, 2 or 12 archives: %v", many)
}

// BenchmarkWarmSync is a restart of the agent on 100 unchanged archives of 10 images (1,000
// references; with their repo@digest names, 2,000) on containerd's own metadata store: the work
// of a warm restart without the gRPC round trips, which make bench measures on a daemon.
func BenchmarkWarmSync(b *testing.B) {
	level := logrus.GetLevel()
	logrus.SetLevel(logrus.WarnLevel) // one line per reference would be most of the output
	b.Cleanup(func() { logrus.SetLevel(level) })
	s := newStore(b)
	for i := range 100 {
		var refs []string
		for j := range 10 {
			refs = append(refs, fmt.Sprintf("bench.example/a%03d-img%d:1.0", i, j))
		}
		writeArchive(b, s.imagesDir, archiveCase{file: fmt.Sprintf("a%03d.tar", i), refs: refs})
	}
	cfg := images.Config{ImagesDir: s.imagesDir, StateFile: filepath.Join(b.TempDir(), "state.json")}
	if err := images.NewAgent(s.cd, cfg).Sync(s.ctx).Err(); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := images.NewAgent(s.cd, cfg).Sync(s.ctx).Err(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestRestoreCallsDoNotGrowWithTheStore: bringing back a deleted reference asks containerd for
// that archive's references, not for a list of the whole store. The restore is the disk-pressure
// path: with 10,000 references, a list of the store per restored archive would cost each restore
// what a whole warm restart costs. The image store calls of one restore are the same beside 2
// archives as beside 12, and no store is listed.
func TestRestoreCallsDoNotGrowWithTheStore(t *testing.T) {
	// restoreSettle is the window in which a restore's calls after its last write are counted:
	// a measurement's span, not a condition waited for.
	const restoreSettle = 500 * time.Millisecond
	n := newNode(t)
	restoreCalls := func(archives int) map[string]int {
		t.Helper()
		// OCI archives: containerd's import of a docker archive walks the content store (filtered,
		// once per image) to find compressed layers, which would blur what this test counts.
		dir, all := scaleImagesDir(t, "restore.example", archives, func(int) bool { return true })
		counter := &callCounter{calls: map[string]int{}}
		client, err := containerd.New(n.daemon.Address, containerd.WithExtraDialOpts(counter.dialOpts()))
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		cfg := images.Config{ImagesDir: dir, StateFile: filepath.Join(t.TempDir(), "state.json")}
		agent := images.NewAgent(images.Services(client), cfg)
		if err := agent.Sync(n.ctx).Err(); err != nil {
			t.Fatalf("sync of %d archives: %v", archives, err)
		}
		ctx, cancel := context.WithCancel(n.ctx)
		done := make(chan error, 1)
		go func() {
			done <- agent.Run(ctx, images.RunOptions{Restore: true, Synced: true, ReconcileInterval: time.Hour})
		}()
		defer func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		}()
		// Run follows containerd's events once its subscription is in place: a probe reference,
		// deleted until it comes back, shows that it is. Its restore's calls are not counted.
		probe := all[len(all)-1]
		n.await(10*time.Second, "Run's event subscription restoring "+probe, func() bool {
			if n.pinnedLabel(probe) {
				if err := n.client.ImageService().Delete(n.ctx, probe); err != nil {
					t.Fatal(err)
				}
			}
			deadline := time.Now().Add(time.Second)
			for time.Now().Before(deadline) {
				if n.pinnedLabel(probe) {
					return true
				}
				time.Sleep(20 * time.Millisecond)
			}
			return false
		})
		time.Sleep(restoreSettle)
		victim := all[0]
		counter.reset()
		// As `ctr images rm`: one reference deleted, through a client the counter does not see.
		if err := n.client.ImageService().Delete(n.ctx, victim); err != nil {
			t.Fatal(err)
		}
		n.await(10*time.Second, victim+" restored", func() bool { return n.pinnedLabel(victim) })
		time.Sleep(restoreSettle)
		for _, ref := range all {
			if !n.pinnedLabel(ref) {
				t.Errorf("%s not pinned after the restore of %s", ref, victim)
			}
		}
		return counter.snapshot()
	}
	few, many := restoreCalls(2), restoreCalls(12)
	// The image store is what the restore asks about; the content calls are containerd's import of
	// the archive (it reads the archive, not the store), and vary by one Info from run to run.
	imageCalls := func(calls map[string]int) map[string]int {
		out := map[string]int{}
		for method, n := range calls {
			if strings.HasPrefix(method, "/containerd.services.images.") {
				out[method] = n
			}
		}
		return out
	}
	if !maps.Equal(imageCalls(few), imageCalls(many)) {
		t.Errorf("image store calls of one restore grow with the store:\n  beside 2 archives:  %v\n  beside 12 archives: %v", few, many)
	}
	for _, calls := range []map[string]int{few, many} {
		for method, n := range calls {
			if strings.HasSuffix(method, "/List") || strings.HasSuffix(method, "/ListStream") {
				t.Errorf("a restore listed a store: %s called %d times", method, n)
			}
		}
	}
	t.Logf("calls of one restore, beside 2 or 12 archives: %v", many)
}

// TestColdLoadMakesTheFewestTransactions: a cold load waits on containerd's metadata
// transactions (one sync of the disk each), and makes about the fewest that any load through
// containerd's API can make to leave the same records (containerdtest.TransactionFloor): each blob
// committed with its labels, the archive's own index not written, one lease for the sync, each
// name created with the CRI's mark beside its image ID record (the CRI updated every name created
// without it). Seen for these 30 images: 583 transactions when labels were written after the
// import, the index written and a lease made per archive; 412 to 416 without, against a floor
// of 410 that counted the CRI's updates; with the names created marked, 355 against 350.
func TestColdLoadMakesTheFewestTransactions(t *testing.T) {
	n := newNode(t)
	dir, tags := scaleImagesDir(t, "tx.example", 10, func(i int) bool { return i%2 == 1 })
	db := containerdtest.MetadataDB(n.daemon.Root)
	before, err := containerdtest.Transactions(db)
	if err != nil {
		t.Fatal(err)
	}
	if err := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: dir}).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// The CRI writes its own records from containerd's events, after the sync: counted once it
	// made one per image ID (each of these images has its own config) and the count stays.
	var floor, blobs, records, ids, tx uint64
	deadline := time.Now().Add(30 * time.Second)
	for {
		if floor, blobs, records, ids, err = containerdtest.TransactionFloor(n.ctx, n.client.ContentStore(), n.client.ImageService()); err != nil {
			t.Fatal(err)
		}
		now, err := containerdtest.Transactions(db)
		if err != nil {
			t.Fatal(err)
		}
		if ids == uint64(len(tags)) && now-before == tx || time.Now().After(deadline) {
			break
		}
		tx = now - before
		time.Sleep(500 * time.Millisecond)
	}
	if ids != uint64(len(tags)) {
		t.Fatalf("the CRI recorded %d image IDs of %d images", ids, len(tags))
	}
	if tx > floor+floor/20 {
		t.Errorf("the cold load of %d images made %d containerd transactions, more than 5%% over their floor %d (%d blobs, %d image records, %d of them the CRI's image IDs)", len(tags), tx, floor, blobs, records, ids)
	}
	t.Logf("%d images: %d transactions, floor %d (%d blobs, %d image records, %d of them the CRI's image IDs)", len(tags), tx, floor, blobs, records, ids)
}

// TestColdLoadLabelsBlobsAsItWritesThem: a cold load commits each blob with its labels (the GC
// labels of a manifest or index, the distribution-source labels of every blob), from what the
// archive's index says each file is, and writes no labels of its own; the GC labels keep every
// blob with its image once the import's lease is gone and containerd's GC has run. A blob another
// archive committed first (the same image under another repository, loaded side by side) gets the
// repository it lacks added, in one update. A load waits on containerd's transactions: labelled
// after the import (one update per blob), the 4 archives of 3 images made 52 label updates.
func TestColdLoadLabelsBlobsAsItWritesThem(t *testing.T) {
	n := newNode(t)
	dir, tags := scaleImagesDir(t, "labels.example", 4, func(i int) bool { return i%2 == 1 })
	// One image in two archives, of two repositories: whichever archive commits a blob first, the
	// other adds its repository.
	shared, err := imagetest.Image(64<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	for _, repo := range []string{"one", "two"} {
		tag := "labels.example/shared-" + repo + ":1.0"
		if err := imagetest.WriteDocker(filepath.Join(dir, "shared-"+repo+".tar"), map[string]v1.Image{tag: shared}); err != nil {
			t.Fatal(err)
		}
		tags = append(tags, tag)
	}
	counter := &callCounter{calls: map[string]int{}}
	client, err := containerd.New(n.daemon.Address, containerd.WithExtraDialOpts(counter.dialOpts()))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if err := images.NewAgent(images.Services(client), images.Config{ImagesDir: dir}).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	updates := counter.snapshot()["/containerd.services.content.v1.Content/Update"]

	// containerd's GC, run to its end: what no image's GC labels reach is gone after it.
	n.collectGarbage()
	cs := n.client.ContentStore()
	blobs, sharedBlobs := map[string]bool{}, map[string]bool{}
	for _, tag := range tags {
		img, err := n.client.ImageService().Get(n.ctx, tag)
		if err != nil {
			t.Fatal(err)
		}
		want := strings.TrimPrefix(strings.Split(tag, ":")[0], "labels.example/")
		if strings.Contains(tag, "/shared-") {
			want = "shared-one,shared-two"
		}
		walk := containerdimages.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
			info, err := cs.Info(ctx, desc.Digest)
			if err != nil {
				return nil, fmt.Errorf("%s: %s (%s) after containerd's GC: %w", tag, desc.Digest, desc.MediaType, err)
			}
			if got := info.Labels[labels.LabelDistributionSource+".labels.example"]; got != want {
				t.Errorf("%s: %s (%s): distribution source %q, want %q", tag, desc.Digest, desc.MediaType, got, want)
			}
			blobs[desc.Digest.String()] = true
			if strings.Contains(tag, "/shared-") {
				sharedBlobs[desc.Digest.String()] = true
			}
			return containerdimages.Children(ctx, cs, desc)
		})
		if err := containerdimages.Walk(n.ctx, walk, img.Target); err != nil {
			t.Error(err)
		}
	}
	if updates != len(sharedBlobs) {
		t.Errorf("the cold load of %d images (%d blobs, %d of them in two archives) updated content labels %d times, want one update per blob of two archives", len(tags), len(blobs), len(sharedBlobs), updates)
	}
	t.Logf("%d images, %d blobs (%d in two archives), %d content label updates; calls: %v", len(tags), len(blobs), len(sharedBlobs), updates, counter.snapshot())
}
