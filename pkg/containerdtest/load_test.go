package containerdtest_test

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/opencontainers/go-digest"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// TestLoadWrittenAgainIsTheSame: what an import left in one containerd (blobs with their labels,
// image records), read and written onto another, is the same there, and takes the transactions
// the floor counts; written again, it is refused (the floor is of a cold load). make bench times
// this write as the floor of a cold load.
func TestLoadWrittenAgainIsTheSame(t *testing.T) {
	from, to := containerdtest.New(t, containerdtest.Options{}), containerdtest.New(t, containerdtest.Options{})
	ctx := namespaces.WithNamespace(t.Context(), pinning.DefaultNamespace)
	src, err := from.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := to.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	tags := map[string]v1.Image{}
	for _, ref := range []string{"acc.example/app-a:1", "acc.example/app-b:1"} {
		if tags[ref], err = imagetest.Image(64<<10, imagetest.Amd64); err != nil {
			t.Fatal(err)
		}
	}
	archive := filepath.Join(t.TempDir(), "two.tar")
	if err := imagetest.WriteDocker(archive, tags); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := src.Import(ctx, f); err != nil {
		t.Fatal(err)
	}
	// The CRI makes each image's ID record and marks the names it did not create, after the
	// import: what is read is what it left once done.
	deadline := time.Now().Add(30 * time.Second)
	for {
		imgs, err := src.ImageService().List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		done := len(imgs) == 4
		for _, img := range imgs {
			done = done && img.Labels[pinning.LabelCRIManaged] != ""
		}
		if done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the CRI did not make its records of the import within 30 s: %d records", len(imgs))
		}
		time.Sleep(20 * time.Millisecond)
	}
	load, err := containerdtest.ReadLoad(ctx, src.ContentStore(), src.ImageService())
	if err != nil {
		t.Fatal(err)
	}
	if len(load.Images) != 4 || len(load.Blobs) < 6 || load.Bytes() < 2*64<<10 {
		t.Fatalf("read %d records and %d blobs (%d bytes) from an import of 2 images: want their names and ID records, their configs, layers and manifests", len(load.Images), len(load.Blobs), load.Bytes())
	}
	meta := containerdtest.MetadataDB(to.Root)
	tx0, err := containerdtest.Transactions(meta)
	if err != nil {
		t.Fatal(err)
	}
	if err := load.Write(ctx, dst.ContentStore(), dst.ImageService(), dst.LeasesService(), 2); err != nil {
		t.Fatal(err)
	}
	tx1, err := containerdtest.Transactions(meta)
	if err != nil {
		t.Fatal(err)
	}
	again, err := containerdtest.ReadLoad(ctx, dst.ContentStore(), dst.ImageService())
	if err != nil {
		t.Fatal(err)
	}
	blobs := func(l *containerdtest.Load) map[digest.Digest]containerdtest.Blob {
		m := map[digest.Digest]containerdtest.Blob{}
		for _, b := range l.Blobs {
			m[b.Desc.Digest] = b
		}
		return m
	}
	if got, want := blobs(again), blobs(load); !reflect.DeepEqual(got, want) {
		t.Errorf("blobs written again: %d, want the %d read (bytes and labels alike)", len(got), len(want))
	}
	if !reflect.DeepEqual(again.Images, load.Images) {
		t.Errorf("records written again: %+v, want %+v", again.Images, load.Images)
	}
	// Two per blob, one per record, the lease's creation and removal, and a collection of
	// containerd's GC once the lease went: the CRI writes nothing, its records are all there.
	floor, _, _, _, err := containerdtest.TransactionFloor(ctx, dst.ContentStore(), dst.ImageService())
	if err != nil {
		t.Fatal(err)
	}
	if n := tx1 - tx0; n < floor || n > floor+3 {
		t.Errorf("the write took %d transactions, want its floor %d, the lease's two and a collection at most", n, floor)
	}
	if err := load.Write(ctx, dst.ContentStore(), dst.ImageService(), dst.LeasesService(), 2); err == nil || !strings.Contains(err.Error(), "already there") {
		t.Errorf("written again onto the same store: %v, want a record already there refused", err)
	}
	var left int
	if err := dst.ContentStore().Walk(ctx, func(content.Info) error { left++; return nil }); err != nil || left != len(load.Blobs) {
		t.Errorf("after the lease went: %d blobs (%v), want the %d the records hold", left, err, len(load.Blobs))
	}
}
