package airgap_test

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/opencontainers/go-digest"
	"github.com/rancher/wharfie/pkg/tarfile"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

func archiveAt(t *testing.T, path string) airgap.Archive {
	t.Helper()
	a, err := airgap.At(path)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestReadIndexMatchesImages: the index names every tag with the image ID (config digest) the
// CRI will report, for both formats and every compression, without importing anything.
func TestReadIndexMatchesImages(t *testing.T) {
	dir := t.TempDir()
	img, err := imagetest.Image(16<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	id, _ := img.ConfigName()
	manifestDigest, _ := img.Digest()
	multi, err := imagetest.MultiPlatform(8<<10, v1.Platform{OS: "linux", Architecture: "arm64"}, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	multiDigest, _ := multi.Digest()
	im, _ := multi.IndexManifest()
	amd64Img, _ := multi.Image(im.Manifests[1].Digest)
	amd64ID, _ := amd64Img.ConfigName()

	for _, ext := range imagetest.Extensions {
		dockerPath := filepath.Join(dir, "d"+ext)
		if err := imagetest.WriteDocker(dockerPath, map[string]v1.Image{"app:1": img, "acc.example/app:2": img}); err != nil {
			t.Fatal(err)
		}
		idx, err := readIndex(archiveAt(t, dockerPath))
		if err != nil {
			t.Fatalf("%s: %v", ext, err)
		}
		got := map[string]string{}
		for _, i := range idx.Images {
			got[i.Ref] = i.ImageID.String()
		}
		if idx.Format != airgap.DockerArchive || len(got) != 2 || got["docker.io/library/app:1"] != id.String() || got["acc.example/app:2"] != id.String() {
			t.Errorf("%s docker index = %v %v, want both tags with image ID %s", ext, idx.Format, got, id)
		}

		ociPath := filepath.Join(dir, "o"+ext)
		if err := imagetest.WriteOCI(ociPath, map[string]any{"acc.example/one:1": img, "acc.example/multi:1": multi}); err != nil {
			t.Fatal(err)
		}
		idx, err = readIndex(archiveAt(t, ociPath))
		if err != nil {
			t.Fatalf("%s: %v", ext, err)
		}
		byRef := map[string]airgap.IndexedImage{}
		for _, i := range idx.Images {
			byRef[i.Ref] = i
		}
		if one := byRef["acc.example/one:1"]; one.Digest.String() != manifestDigest.String() || one.ImageID.String() != id.String() {
			t.Errorf("%s oci single: %+v", ext, one)
		}
		if m := byRef["acc.example/multi:1"]; m.Digest.String() != multiDigest.String() || m.ImageID.String() != amd64ID.String() {
			t.Errorf("%s oci multi: %+v, want index digest %s and the linux/amd64 image ID %s", ext, m, multiDigest, amd64ID)
		}
	}
}

func TestReadIndexRejectsBadArchives(t *testing.T) {
	dir := t.TempDir()
	img, _ := imagetest.Image(256<<10, imagetest.Amd64)
	good := filepath.Join(dir, "good.tar")
	if err := imagetest.WriteDocker(good, map[string]v1.Image{"app:1": img}); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(good)
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for path, want := range map[string]string{
		write("truncated.tar", data[:len(data)/2]):          "",
		write("empty.tar", nil):                             "not an image archive",
		write("corrupt.tar.gz", []byte("\x1f\x8b garbage")): "",
		write("corrupt.tar.zst", []byte("not zstd at all")): "",
	} {
		_, err := readIndex(archiveAt(t, path))
		if err == nil {
			t.Errorf("%s: read without error", filepath.Base(path))
			continue
		}
		if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %q does not name the file (and %q)", filepath.Base(path), err, want)
		}
	}
}

func TestReadListNamesBadLines(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pull.txt")
	content := "# comment\n\ndocker.io/library/redis:7\nnginx\n  Not A Ref  \n" + strings.Repeat("x", 5000) + "\n"
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	idx, err := readIndex(archiveAt(t, path))
	if err == nil || !strings.Contains(err.Error(), "pull.txt:5") || !strings.Contains(err.Error(), "pull.txt:6") {
		t.Errorf("error %v does not name lines 5 and 6", err)
	}
	var refs []string
	for _, i := range idx.Images {
		refs = append(refs, i.Ref)
	}
	if strings.Join(refs, " ") != "docker.io/library/redis:7 docker.io/library/nginx:latest" {
		t.Errorf("good lines = %v", refs)
	}
}

func TestScanSkipsHiddenAndNamesUnsupported(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"a.tar", "B.TAR.GZ", "c.txt", ".cache.json", "d.zip", "e.tar.xz"} {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.Mkdir(filepath.Join(dir, "sub"), 0o755)
	archives, errs := airgap.Scan(dir)
	var names []string
	for _, a := range archives {
		names = append(names, a.Name())
	}
	if strings.Join(names, " ") != "B.TAR.GZ a.tar c.txt" {
		t.Errorf("archives = %v", names)
	}
	if len(errs) != 2 || !strings.Contains(errs[0].Error(), "d.zip") || !strings.Contains(errs[1].Error(), "e.tar.xz") {
		t.Errorf("errors = %v, want d.zip and e.tar.xz named", errs)
	}
}

// TestReadIndexSaysWhatEachFileIs: the index says which images each file of an archive is content
// of (by its name in the archive, as containerd's import names its writes), and which files are
// manifests or indexes: a docker archive's config and layers, an OCI layout's every blob of every
// platform. An import labels each blob from it as it writes it.
func TestReadIndexSaysWhatEachFileIs(t *testing.T) {
	dir := t.TempDir()
	img, err := imagetest.Image(4<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	other, err := imagetest.Image(4<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	multi, err := imagetest.MultiPlatform(4<<10, v1.Platform{OS: "linux", Architecture: "arm64"}, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	blobs := func(img v1.Image) []v1.Hash {
		t.Helper()
		m, err := img.Manifest()
		if err != nil {
			t.Fatal(err)
		}
		out := []v1.Hash{m.Config.Digest}
		for _, l := range m.Layers {
			out = append(out, l.Digest)
		}
		return out
	}
	check := func(idx *airgap.Index, name string, want ...string) {
		t.Helper()
		if got := idx.Content.Refs[name]; strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("%s: %s is content of %q, want %q", idx.Format, name, got, want)
		}
	}

	// docker: go-containerregistry names a config by its digest and a layer <hex>.tar.gz.
	dockerPath := filepath.Join(dir, "d.tar")
	if err := imagetest.WriteDocker(dockerPath, map[string]v1.Image{"acc.example/app:1": img, "acc.example/other:1": other}); err != nil {
		t.Fatal(err)
	}
	idx, err := readIndex(archiveAt(t, dockerPath))
	if err != nil {
		t.Fatal(err)
	}
	for ref, image := range map[string]v1.Image{"acc.example/app:1": img, "acc.example/other:1": other} {
		for i, h := range blobs(image) {
			name := h.Hex + ".tar.gz"
			if i == 0 {
				name = h.String()
			}
			check(idx, name, ref)
		}
	}
	if len(idx.Content.MediaTypes) != 0 {
		t.Errorf("docker archive: manifests %v, want none (containerd writes them)", idx.Content.MediaTypes)
	}

	// OCI: every blob of both platforms, the index and manifests with their media types.
	ociPath := filepath.Join(dir, "o.tar")
	if err := imagetest.WriteOCI(ociPath, map[string]any{"acc.example/one:1": img, "acc.example/multi:1": multi}); err != nil {
		t.Fatal(err)
	}
	if idx, err = readIndex(archiveAt(t, ociPath)); err != nil {
		t.Fatal(err)
	}
	path := func(h v1.Hash) string { return "blobs/sha256/" + h.Hex }
	one, _ := img.Digest()
	check(idx, path(one), "acc.example/one:1")
	for _, h := range blobs(img) {
		check(idx, path(h), "acc.example/one:1")
	}
	multiDigest, _ := multi.Digest()
	check(idx, path(multiDigest), "acc.example/multi:1")
	im, _ := multi.IndexManifest()
	for _, m := range im.Manifests {
		check(idx, path(m.Digest), "acc.example/multi:1")
		platformImg, err := multi.Image(m.Digest)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range blobs(platformImg) {
			check(idx, path(h), "acc.example/multi:1")
		}
		if got := idx.Content.MediaTypes[path(m.Digest)]; got != string(m.MediaType) {
			t.Errorf("oci: manifest %s media type %q, want %q", m.Digest, got, m.MediaType)
		}
	}
	if got := idx.Content.MediaTypes[path(multiDigest)]; got != "application/vnd.oci.image.index.v1+json" {
		t.Errorf("oci: index media type %q", got)
	}
	if refs := idx.Content.Refs["index.json"]; refs != nil {
		t.Errorf("oci: index.json is content of %q, want no image's", refs)
	}
}

// oneImageArchive writes app.tar, a docker archive of one image with a random layer of size
// bytes, in a temp dir.
func oneImageArchive(t *testing.T, size int64) (string, airgap.Archive) {
	t.Helper()
	img, err := imagetest.Image(size, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "app.tar")
	if err := imagetest.WriteDocker(path, map[string]v1.Image{"acc.example/app:1": img}); err != nil {
		t.Fatal(err)
	}
	return path, archiveAt(t, path)
}

func readIndex(a airgap.Archive) (*airgap.Index, error) {
	idx, _, err := airgap.ReadFile(a)
	return idx, err
}

// TestReadHashesWhatItIndexes: one pass gives the index and the digest of the content. The same
// content read through another opener (bytes in memory) gives the same index and digest; a
// touched file (new mtime) keeps its digest; different content changes it.
func TestReadHashesWhatItIndexes(t *testing.T) {
	path, a := oneImageArchive(t, 4<<10)
	idx, d, err := airgap.ReadFile(a)
	if err != nil || d == "" {
		t.Fatalf("ReadFile: %v, digest %q", err, d)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := digest.FromBytes(data); d != want {
		t.Errorf("digest of an uncompressed tar %s, want the file's %s", d, want)
	}
	memIdx, memD, err := airgap.Read(a, func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil || memD != d || len(memIdx.Images) != 1 || memIdx.Images[0] != idx.Images[0] {
		t.Errorf("read from memory: %v %s %+v, want %s %+v", err, memD, memIdx, d, idx)
	}
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(path, later, later); err != nil {
		t.Fatal(err)
	}
	if _, touched, err := airgap.ReadFile(archiveAt(t, path)); err != nil || touched != d {
		t.Errorf("touched: digest %s, %v; want %s", touched, err, d)
	}
	other, err := imagetest.Image(4<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	if err := imagetest.WriteDocker(path, map[string]v1.Image{"acc.example/app:1": other}); err != nil {
		t.Fatal(err)
	}
	if _, replaced, err := airgap.ReadFile(archiveAt(t, path)); err != nil || replaced == d {
		t.Errorf("replaced content: digest %s, %v; want a digest other than %s", replaced, err, d)
	}
}

// FuzzRead: whatever content an archive of the images dir yields (a tar stream, or a list's
// text), Read returns an index whose every image has a reference, or an error naming the file;
// it never panics or hangs. The content is read from memory, through an Opener: no file per
// input.
func FuzzRead(f *testing.F) {
	dir := f.TempDir()
	img, err := imagetest.Image(1<<10, imagetest.Amd64)
	if err != nil {
		f.Fatal(err)
	}
	seeds := map[string]func(string) error{
		"docker.tar": func(p string) error {
			return imagetest.WriteDocker(p, map[string]v1.Image{"fuzz.example/app-a:1": img})
		},
		"oci.tar": func(p string) error { return imagetest.WriteOCI(p, map[string]any{"fuzz.example/app-b:1": img}) },
	}
	for name, write := range seeds {
		path := filepath.Join(dir, name)
		if err := write(path); err != nil {
			f.Fatal(err)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data, false)
		f.Add(data[:len(data)/2], false)
	}
	f.Add([]byte("fuzz.example/app-d:1\n# comment\n\nnot a reference!!\n"), true)
	f.Fuzz(func(t *testing.T, data []byte, list bool) {
		a := airgap.Archive{Path: "/images/fuzz.tar", Size: int64(len(data))}
		if list {
			a.Path = "/images/fuzz.txt"
		}
		open := func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
		type result struct {
			idx *airgap.Index
			err error
		}
		done := make(chan result, 1)
		go func() {
			idx, _, err := airgap.Read(a, open)
			done <- result{idx, err}
		}()
		var r result
		select {
		case r = <-done:
		case <-time.After(5 * time.Second):
			t.Fatalf("Read of %d bytes as %s did not return within 5 s", len(data), a.Path)
		}
		if r.err != nil {
			if !strings.Contains(r.err.Error(), a.Path) {
				t.Errorf("error does not name the file: %v", r.err)
			}
			return
		}
		for _, img := range r.idx.Images {
			if img.Ref == "" {
				t.Errorf("image without a reference in %+v", r.idx.Images)
			}
		}
	})
}

// TestReadIndexSeeksPastLayers: an archive never recorded is indexed without its digest: of an
// uncompressed archive only the metadata is read, the tar reader seeking past each layer, and the
// index is Read's. FileOpener yields such an archive as the file itself, which seeks.
func TestReadIndexSeeksPastLayers(t *testing.T) {
	path, a := oneImageArchive(t, 8<<20)
	want, _, err := airgap.ReadFile(a)
	if err != nil {
		t.Fatal(err)
	}
	var f *imagetest.CountingFile
	idx, err := airgap.ReadIndex(a, func() (io.ReadCloser, error) {
		file, err := os.Open(path)
		f = &imagetest.CountingFile{File: file}
		return f, err
	})
	if err != nil {
		t.Fatal(err)
	}
	if f.BytesRead > 1<<20 {
		t.Errorf("ReadIndex read %d of the archive's %d bytes, want its metadata only", f.BytesRead, a.Size)
	}
	if !reflect.DeepEqual(idx, want) {
		t.Errorf("ReadIndex: %+v, want Read's %+v", idx, want)
	}
	rc, err := airgap.FileOpener(a)()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	if _, ok := rc.(io.Seeker); !ok {
		t.Errorf("FileOpener yields an uncompressed archive as %T, which does not seek", rc)
	}
	// Truncated inside its layer, it is still refused, sought past or not.
	if err := os.Truncate(path, a.Size-(4<<20)); err != nil {
		t.Fatal(err)
	}
	if _, err := airgap.ReadIndex(archiveAt(t, path), airgap.FileOpener(archiveAt(t, path))); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("ReadIndex of a truncated archive: %v, want an error naming it", err)
	}
}

// TestReadsLZ4FramesWharfieRejects: testdata/v2-rejects.tar.lz4 is a valid lz4 frame (a docker
// archive of two tags of one image, written by imagetest) that the amd64 decoder of pierrec/lz4
// v2, wharfie's and so k3s's, rejects; the archive reader loads it.
func TestReadsLZ4FramesWharfieRejects(t *testing.T) {
	path := filepath.Join(t.TempDir(), "v2-rejects.tar.lz4")
	data, err := os.ReadFile("testdata/v2-rejects.tar.lz4")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	idx, _, err := airgap.ReadFile(archiveAt(t, path))
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for _, img := range idx.Images {
		refs = append(refs, img.Ref)
	}
	if idx.Format != airgap.DockerArchive || !reflect.DeepEqual(refs, []string{"docker.io/library/app:1", "acc.example/app:2"}) {
		t.Errorf("index: %s %v, want the docker archive's two tags", idx.Format, refs)
	}
	open, err := tarfile.GetOpener(path)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := open()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	_, err = io.Copy(io.Discard, rc)
	t.Logf("wharfie's own decoder on it: %v", err)
}
