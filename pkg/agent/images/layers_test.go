package images_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/content"
	containerdimages "github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

// tarOf is a tar stream of the named files, in order.
func tarOf(t *testing.T, files ...[2]string) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, f := range files {
		if err := tw.WriteHeader(&tar.Header{Name: f[0], Mode: 0o644, Size: int64(len(f[1])), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(f[1])); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// dockerSave writes a docker archive as `docker save` does: the layer as an uncompressed tar.
func dockerSave(t *testing.T, path, ref string, layer []byte) {
	t.Helper()
	config, err := json.Marshal(ocispec.Image{
		Platform: ocispec.Platform{OS: "linux", Architecture: platforms.DefaultSpec().Architecture},
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(layer)}},
	})
	if err != nil {
		t.Fatal(err)
	}
	configName := digest.FromBytes(config).Encoded() + ".json"
	manifest, err := json.Marshal([]map[string]any{{"Config": configName, "RepoTags": []string{ref}, "Layers": []string{"layer/layer.tar"}}})
	if err != nil {
		t.Fatal(err)
	}
	archive := tarOf(t, [2]string{configName, string(config)}, [2]string{"layer/layer.tar", string(layer)}, [2]string{"manifest.json", string(manifest)})
	if err := os.WriteFile(path, archive, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestImportUsesACompressedCopyOfALayer: a docker archive (uncompressed layers, as `docker save`
// writes them) whose layer the store already holds compressed (a pull left it, labelled with its
// uncompressed digest) is imported onto that compressed blob, as containerd's own import does.
// The sync answers containerd's query for such blobs from its one walk of the content store.
func TestImportUsesACompressedCopyOfALayer(t *testing.T) {
	n := newNode(t)
	pulled := tarOf(t, [2]string{"etc/pulled", "a layer the store holds compressed"})
	fresh := tarOf(t, [2]string{"etc/fresh", "a layer only the archive has"})
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	if _, err := zw.Write(pulled); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	compressed := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(gz.Bytes()), Size: int64(gz.Len())}
	// A lease stands for the pulled image that refers to the blob: unreferenced, containerd's GC
	// would collect it.
	if err := content.WriteBlob(n.leased(), n.client.ContentStore(), "pulled-layer", bytes.NewReader(gz.Bytes()), compressed,
		content.WithLabels(map[string]string{"containerd.io/uncompressed": digest.FromBytes(pulled).String()})); err != nil {
		t.Fatal(err)
	}
	dockerSave(t, filepath.Join(n.imagesDir, "pulled.tar"), "layers.example/pulled:1.0", pulled)
	dockerSave(t, filepath.Join(n.imagesDir, "fresh.tar"), "layers.example/fresh:1.0", fresh)

	if err := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir}).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	layerOf := func(ref string) ocispec.Descriptor {
		t.Helper()
		img, err := n.client.ImageService().Get(n.ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		m, err := containerdimages.Manifest(n.ctx, n.client.ContentStore(), img.Target, platforms.Default())
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Layers) != 1 {
			t.Fatalf("%s: %d layers", ref, len(m.Layers))
		}
		return m.Layers[0]
	}
	if got := layerOf("layers.example/pulled:1.0"); got.Digest != compressed.Digest || !strings.HasSuffix(got.MediaType, "gzip") {
		t.Errorf("the layer the store held compressed: imported as %s (%s), want the compressed blob %s (gzip)", got.Digest, got.MediaType, compressed.Digest)
	}
	if got := layerOf("layers.example/fresh:1.0"); got.Digest != digest.FromBytes(fresh) {
		t.Errorf("the layer only the archive has: imported as %s, want the archive's %s", got.Digest, digest.FromBytes(fresh))
	}
}

// TestHeadReaderReadsPastItsHeadFromContainerd: a blob the import committed is read from the start
// its writer kept, and past it from containerd (opened once, only then); a blob kept whole is
// read to its end, with io.EOF after it, without containerd.
func TestHeadReaderReadsPastItsHeadFromContainerd(t *testing.T) {
	n := newNode(t)
	ctx := n.leased()
	blob := make([]byte, 100<<10)
	if _, err := rand.Read(blob); err != nil {
		t.Fatal(err)
	}
	desc := ocispec.Descriptor{Digest: digest.FromBytes(blob), Size: int64(len(blob))}
	if err := content.WriteBlob(ctx, n.client.ContentStore(), "head-test", bytes.NewReader(blob), desc); err != nil {
		t.Fatal(err)
	}
	opened := 0
	open := func() (content.ReaderAt, error) { opened++; return n.client.ContentStore().ReaderAt(ctx, desc) }
	r := images.HeadReaderAt(blob[:32<<10], desc.Size, open)
	defer r.Close()
	p := make([]byte, 10)
	if k, err := r.ReadAt(p, 100); err != nil || k != 10 || !bytes.Equal(p, blob[100:110]) || opened != 0 {
		t.Errorf("inside the head: %d bytes, %v, opened %d times; want its 10 bytes from memory", k, err, opened)
	}
	got, err := io.ReadAll(io.NewSectionReader(r, 0, r.Size()))
	if err != nil || !bytes.Equal(got, blob) || opened != 1 {
		t.Errorf("the whole blob: %d bytes (%v), equal %t, containerd opened %d times; want its %d bytes, opened once", len(got), err, bytes.Equal(got, blob), opened, len(blob))
	}
	small := blob[:1000]
	opened = 0
	whole := images.HeadReaderAt(small, int64(len(small)), open)
	p = make([]byte, 100)
	if k, err := whole.ReadAt(p, 950); k != 50 || err != io.EOF || !bytes.Equal(p[:50], small[950:]) {
		t.Errorf("past the end of a blob kept whole: %d bytes, %v; want its last 50 and io.EOF", k, err)
	}
	if k, err := whole.ReadAt(p, 1000); k != 0 || err != io.EOF || opened != 0 {
		t.Errorf("at the end of a blob kept whole: %d bytes, %v, containerd opened %d times; want io.EOF from memory", k, err, opened)
	}
}

// TestLayoutBlobsAreWrittenAsTheirNames: an OCI layout's blobs are written as the digests their
// names give, which containerd checks as it commits: the import does not hash them again, and a
// blob the store holds is not read at all (the tar reader seeks past it). containerd's
// ImportIndex reads and hashes every blob whatever the store holds.
func TestLayoutBlobsAreWrittenAsTheirNames(t *testing.T) {
	n := newNode(t)
	ctx := n.leased()
	img, err := imagetest.Image(4<<20, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "layout.tar")
	if err := imagetest.WriteOCI(path, map[string]any{"acc.example/layout:1": img}); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	cs := n.client.ContentStore()
	load := func() (ocispec.Descriptor, int64) {
		t.Helper()
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		r := &imagetest.CountingFile{File: f}
		desc, err := images.ImportLayout(ctx, cs, r)
		if err != nil {
			t.Fatal(err)
		}
		return desc, r.BytesRead
	}
	desc, first := load()
	var index []byte
	for _, e := range readTarEntries(t, path) {
		if e.hdr.Name == "index.json" {
			index = e.data
		}
	}
	if desc.Digest != digest.FromBytes(index) || desc.Size != int64(len(index)) || desc.MediaType != ocispec.MediaTypeImageIndex {
		t.Fatalf("import returned %+v; want index.json's descriptor (%s, %d bytes)", desc, digest.FromBytes(index), len(index))
	}
	if _, _, _, missing, err := containerdimages.Check(ctx, cs, desc, platforms.Default()); err != nil || len(missing) > 0 {
		t.Fatalf("after the import: %d blobs missing (%v); want the image whole", len(missing), err)
	}
	if first < st.Size()*9/10 {
		t.Errorf("the first import read %d of the archive's %d bytes; want it read through", first, st.Size())
	}
	if _, again := load(); again > 256<<10 {
		t.Errorf("importing it again read %d of the archive's %d bytes; want its blobs, all in the store, sought past (under 256 KiB read)", again, st.Size())
	}
}
