package images_test

// Hostile input: files that anyone with write access to the images dir can drop in. Each must get
// a clear error naming the file, and nothing else may be affected: the good archive beside them
// still loads, and nothing of the hostile one reaches containerd.

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/klauspost/compress/zstd"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// tarEntry is one entry of a crafted archive.
type tarEntry struct {
	hdr  tar.Header
	data []byte
}

func readTarEntries(t *testing.T, path string) []tarEntry {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []tarEntry
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, tarEntry{hdr: *hdr, data: data})
	}
}

func writeTarEntries(t *testing.T, w io.Writer, entries []tarEntry) {
	t.Helper()
	tw := tar.NewWriter(w)
	for _, e := range entries {
		hdr := e.hdr
		if hdr.Typeflag == tar.TypeReg || hdr.Typeflag == 0 {
			hdr.Size = int64(len(e.data))
		}
		if err := tw.WriteHeader(&hdr); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(e.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
}

// craft writes path as the uncompressed docker or OCI archive of one random image tagged ref,
// changed by edit.
func craft(t *testing.T, path, ref string, oci bool, edit func([]tarEntry) []tarEntry) {
	t.Helper()
	img, err := imagetest.Image(32<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	plain := path + ".plain.tar"
	if oci {
		err = imagetest.WriteOCI(plain, map[string]any{ref: img})
	} else {
		err = imagetest.WriteDocker(plain, map[string]v1.Image{ref: img})
	}
	if err != nil {
		t.Fatal(err)
	}
	entries := edit(readTarEntries(t, plain))
	os.Remove(plain)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	writeTarEntries(t, f, entries)
}

func reg(name string, data []byte) tarEntry {
	return tarEntry{hdr: tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644}, data: data}
}

// largest is the index of the biggest regular entry: the layer of a one-image archive.
func largest(entries []tarEntry) int {
	best := 0
	for i, e := range entries {
		if len(e.data) > len(entries[best].data) {
			best = i
		}
	}
	return best
}

// syncExpect syncs and checks that the error names every file with its reason, that good is
// present and pinned, and that no reference of the hostile archives exists.
func (n *node) syncExpect(a *images.Agent, good string, want map[string]string, absent ...string) *images.SyncReport {
	n.t.Helper()
	report := a.Sync(n.ctx)
	err := report.Err()
	if err == nil {
		n.t.Fatal("sync over hostile archives reported no error")
	}
	for file, reason := range want {
		found := false
		for _, e := range strings.Split(err.Error(), "\n") {
			if strings.Contains(e, file) && strings.Contains(e, reason) {
				found = true
			}
		}
		if !found {
			n.t.Errorf("no error names %s with %q:\n%v", file, reason, err)
		}
	}
	if present, pinned := n.criPinned(good); !present || !pinned {
		n.t.Errorf("%s beside the hostile archives: present=%t pinned=%t", good, present, pinned)
	}
	for _, ref := range absent {
		if _, err := n.client.ImageService().Get(n.ctx, ref); err == nil {
			n.t.Errorf("%s from a hostile archive was created", ref)
		}
	}
	return report
}

func TestHostileTarEntriesAreRefused(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "good.tar.gz", refs: []string{"acc.example/good:1.0"}})
	add := func(extra ...tarEntry) func([]tarEntry) []tarEntry {
		return func(es []tarEntry) []tarEntry { return append(es, extra...) }
	}
	outside := filepath.Join(t.TempDir(), "written-outside")
	craft(t, filepath.Join(n.imagesDir, "dotdot.tar"), "acc.example/dotdot:1", false,
		add(reg("../../../../../../.."+outside, []byte("x"))))
	craft(t, filepath.Join(n.imagesDir, "absolute.tar"), "acc.example/absolute:1", true,
		add(reg(outside, []byte("x"))))
	craft(t, filepath.Join(n.imagesDir, "symlink-out.tar"), "acc.example/symlink-out:1", false,
		add(tarEntry{hdr: tar.Header{Name: "evil.json", Typeflag: tar.TypeSymlink, Linkname: "../../../etc/passwd"}}))
	craft(t, filepath.Join(n.imagesDir, "symlink-abs.tar"), "acc.example/symlink-abs:1", true,
		add(tarEntry{hdr: tar.Header{Name: "blobs/sha256/evil", Typeflag: tar.TypeSymlink, Linkname: "/etc/shadow"}}))
	// The layer a docker manifest names, turned into a hard link to another entry.
	craft(t, filepath.Join(n.imagesDir, "hardlink.tar"), "acc.example/hardlink:1", false, func(es []tarEntry) []tarEntry {
		i := largest(es)
		es = append(es, reg("other.bin", es[i].data))
		es[i] = tarEntry{hdr: tar.Header{Name: es[i].hdr.Name, Typeflag: tar.TypeLink, Linkname: "other.bin"}}
		return es
	})
	n.syncExpect(n.agent(nil), "acc.example/good:1.0", map[string]string{
		"dotdot.tar":      "points outside the archive",
		"absolute.tar":    "points outside the archive",
		"symlink-out.tar": "points outside the archive",
		"symlink-abs.tar": "points outside the archive",
		"hardlink.tar":    "hard link",
	}, "docker.io/acc.example/dotdot:1", "acc.example/dotdot:1", "acc.example/absolute:1", "acc.example/symlink-out:1",
		"acc.example/symlink-abs:1", "acc.example/hardlink:1")
	if _, err := os.Stat(outside); err == nil {
		t.Errorf("%s was written", outside)
	}
}

// TestBlobsTheArchiveLacks: a manifest naming a layer the archive does not hold is refused when
// indexed; a layer whose content does not match its name passes the index (entries are checked by
// name) and is caught after import, before any reference is created.
func TestBlobsTheArchiveLacks(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "good.tar", refs: []string{"acc.example/good:1.0"}})
	craft(t, filepath.Join(n.imagesDir, "missing-layer.tar"), "acc.example/missing:1", true, func(es []tarEntry) []tarEntry {
		i := largest(es)
		return append(es[:i], es[i+1:]...)
	})
	craft(t, filepath.Join(n.imagesDir, "missing-config.tar"), "acc.example/missing-config:1", false, func(es []tarEntry) []tarEntry {
		var out []tarEntry
		for _, e := range es {
			if !strings.HasPrefix(e.hdr.Name, "sha256:") { // go-containerregistry names the config sha256:<hex>
				out = append(out, e)
			}
		}
		return out
	})
	craft(t, filepath.Join(n.imagesDir, "wrong-content.tar"), "acc.example/wrong:1", true, func(es []tarEntry) []tarEntry {
		i := largest(es)
		data := bytes.Clone(es[i].data)
		data[len(data)/2] ^= 0xff
		es[i].data = data
		return es
	})
	n.syncExpect(n.agent(nil), "acc.example/good:1.0", map[string]string{
		"missing-layer.tar":  "is missing from the archive",
		"missing-config.tar": "is missing from the archive",
		"wrong-content.tar":  "its bytes are not the digest its name gives",
	}, "acc.example/missing:1", "docker.io/acc.example/missing-config:1", "acc.example/wrong:1")
}

// TestDecompressionBombIsRefused: archives that expand far beyond their size are refused before
// they are expanded, and containerd's root does not grow by what they would expand to.
func TestDecompressionBombIsRefused(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "good.tar.zst", refs: []string{"acc.example/good:1.0"}})
	const bombSize = 1 << 30
	zeros := func(w io.Writer, name string) {
		tw := tar.NewWriter(w)
		if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Size: bombSize, Mode: 0o644}); err != nil {
			t.Fatal(err)
		}
		if _, err := io.CopyN(tw, zeroReader{}, bombSize); err != nil {
			t.Fatal(err)
		}
		tw.Close()
	}
	write := func(name string, fill func(f *os.File)) {
		f, err := os.Create(filepath.Join(n.imagesDir, name))
		if err != nil {
			t.Fatal(err)
		}
		fill(f)
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
	}
	write("bomb.tar.zst", func(f *os.File) {
		zw, _ := zstd.NewWriter(f)
		zeros(zw, "manifest.json")
		zw.Close()
	})
	write("bomb.tar.gz", func(f *os.File) {
		zw, _ := gzip.NewWriterLevel(f, gzip.BestCompression)
		zeros(zw, "blobs/sha256/0000")
		zw.Close()
	})
	// A header that claims 4 GiB (what a sparse entry does in a few bytes) and no data.
	write("claims-4gib.tar", func(f *os.File) {
		hdr := tar.Header{Name: "manifest.json", Typeflag: tar.TypeReg, Size: 4 << 30, Mode: 0o644, Format: tar.FormatUSTAR}
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(&hdr)
		f.Write(buf.Bytes()[:512])
	})
	// A zstd frame that asks for a 256 MiB window: the decoder's memory stays bounded (32 MiB, as
	// k3s sets it), so it is refused rather than allocated.
	write("big-window.tar.zst", func(f *os.File) {
		zw, err := zstd.NewWriter(f, zstd.WithWindowSize(256<<20))
		if err != nil {
			t.Fatal(err)
		}
		data := make([]byte, 40<<20)
		rand.New(rand.NewSource(1)).Read(data)
		zw.Write(data)
		zw.Close()
	})
	before := duBytes(t, n.daemon.Root)
	n.syncExpect(n.agent(nil), "acc.example/good:1.0", map[string]string{
		"bomb.tar.zst":       "decompression bomb",
		"bomb.tar.gz":        "decompression bomb",
		"claims-4gib.tar":    "decompression bomb",
		"big-window.tar.zst": "larger than the 32 MiB",
	})
	if grown := duBytes(t, n.daemon.Root) - before; grown > 64<<20 {
		t.Errorf("containerd's root grew by %d MiB over the bombs", grown>>20)
	}
}

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) { clear(p); return len(p), nil }

func duBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var total int64
	filepath.Walk(dir, func(_ string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				total += st.Blocks * 512
			}
		}
		return nil
	})
	return total
}

// TestConflictingArchivesFirstByNameWins: two tarballs provide one reference with different
// images. The first by name provides it, every sync leaves both alone (nothing is re-imported, the
// reference does not flip), the later one's other references still load, doctor shows the
// conflict, and when the first leaves, the second's image takes the reference.
func TestConflictingArchivesFirstByNameWins(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "a.tar", refs: []string{"acc.example/app:1.0", "acc.example/only-a:1.0"}})
	writeArchive(t, n.imagesDir, archiveCase{file: "b.tar.zst", oci: true, refs: []string{"acc.example/app:1.0", "acc.example/only-b:1.0"}})
	a := n.agent(nil)
	var first string
	for i := 0; i < 3; i++ {
		report := a.Sync(n.ctx)
		if err := report.Err(); err != nil {
			t.Fatal(err)
		}
		app, err := n.client.ImageService().Get(n.ctx, "acc.example/app:1.0")
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = app.Target.Digest.String()
		} else if app.Target.Digest.String() != first {
			t.Errorf("sync %d: acc.example/app:1.0 flipped from %s to %s", i+1, first, app.Target.Digest)
		}
		if src := app.Labels[pinning.LabelSource]; src != "a.tar" {
			t.Errorf("sync %d: acc.example/app:1.0 recorded for %q, want a.tar", i+1, src)
		}
		for _, ar := range report.Archives {
			if i > 0 && ar.Imported {
				t.Errorf("sync %d: %s imported again", i+1, ar.Archive.Name())
			}
			if ar.Archive.Name() == "b.tar.zst" && (len(ar.Shadowed) != 1 || ar.Shadowed[0].Owner != "a.tar") {
				t.Errorf("sync %d: b.tar.zst shadowed = %v, want acc.example/app:1.0 owned by a.tar", i+1, ar.Shadowed)
			}
		}
	}
	for _, ref := range []string{"acc.example/only-a:1.0", "acc.example/only-b:1.0"} {
		if present, pinned := n.criPinned(ref); !present || !pinned {
			t.Errorf("%s: present=%t pinned=%t", ref, present, pinned)
		}
	}
	snap, err := a.Inspect(n.ctx)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, c := range snap.Conflicts {
		if c.Ref == "acc.example/app:1.0" && c.Owner == "a.tar" && c.Shadowed == "b.tar.zst" {
			found = true
		}
	}
	if !found {
		t.Errorf("the snapshot (what doctor reports) does not show the conflict: %+v", snap.Conflicts)
	}
	os.Remove(filepath.Join(n.imagesDir, "a.tar"))
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	app, err := n.client.ImageService().Get(n.ctx, "acc.example/app:1.0")
	if err != nil {
		t.Fatal(err)
	}
	if app.Target.Digest.String() == first || app.Labels[pinning.LabelSource] != "b.tar.zst" || !pinning.IsPinned(app.Labels) {
		t.Errorf("after a.tar left: app:1.0 -> %s labels %v, want b.tar.zst's image pinned for it", app.Target.Digest, app.Labels)
	}
}

// TestImagesDirSymlinksAndSpecialFiles: the documented rule. A symlink is followed wherever it
// points (as k3s opens it) and the link's name is the source; only regular files are read, so a
// FIFO or a device never blocks the agent; a dangling link is an error naming it.
func TestImagesDirSymlinksAndSpecialFiles(t *testing.T) {
	n := newNode(t)
	media := t.TempDir()
	writeArchive(t, media, archiveCase{file: "on-media.tar", refs: []string{"acc.example/linked:1.0"}})
	if err := os.Symlink(filepath.Join(media, "on-media.tar"), filepath.Join(n.imagesDir, "linked.tar")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(n.imagesDir, "fifo.tar"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/dev/zero", filepath.Join(n.imagesDir, "zero.tar.gz")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(media, "gone.tar"), filepath.Join(n.imagesDir, "dangling.tar")); err != nil {
		t.Fatal(err)
	}
	n.syncExpect(n.agent(nil), "acc.example/linked:1.0", map[string]string{
		"fifo.tar":     "not a regular file",
		"zero.tar.gz":  "not a regular file",
		"dangling.tar": "no such file",
	})
	if src := n.labels("acc.example/linked:1.0")[pinning.LabelSource]; src != "linked.tar" {
		t.Errorf("source %q, want the link's name linked.tar", src)
	}
}

// TestHostileListLines: a huge line, binary junk and thousands of entries in a .txt list. Each bad
// line is named (up to a bound), the lines after a huge one are still read, duplicates are pulled
// once, and the good entry is pinned.
func TestHostileListLines(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "good.tar", refs: []string{"acc.example/good:1.0", "acc.example/listed:1.0"}})
	junk := make([]byte, 4096)
	rand.New(rand.NewSource(7)).Read(junk)
	var list bytes.Buffer
	list.WriteString(strings.Repeat("a", 1<<20) + "\n")   // line 1: 1 MiB
	list.WriteString("acc.example/listed:1.0\n")          // line 2: still read
	list.Write(bytes.ReplaceAll(junk, []byte("\n"), nil)) // line 3: binary junk
	list.WriteString("\n")
	for i := 0; i < 5000; i++ {
		list.WriteString("acc.example/listed:1.0\n# comment\nBAD REF\n")
	}
	if err := os.WriteFile(filepath.Join(n.imagesDir, "z-pull.txt"), list.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	report := n.syncExpect(n.agent(nil), "acc.example/listed:1.0", map[string]string{
		"z-pull.txt:1": "longer than 4096 bytes",
		"z-pull.txt:3": "is not an image reference",
		"z-pull.txt":   "more than 20 bad lines",
	})
	for _, ar := range report.Archives {
		if ar.Archive.Name() != "z-pull.txt" {
			continue
		}
		listed := 0
		for _, r := range ar.Refs {
			if r.Ref == "acc.example/listed:1.0" {
				listed++
			}
		}
		if listed != 1 {
			t.Errorf("list refs = %+v, want acc.example/listed:1.0 once (5001 lines name it)", ar.Refs)
		}
		if lines := strings.Count(ar.Err.Error(), "\n") + 1; lines > 25 {
			t.Errorf("%d error lines for one list", lines)
		}
		if strings.Contains(ar.Err.Error(), strings.Repeat("a", 100)) {
			t.Error("the huge line is echoed in the error")
		}
	}
}

// TestUnreadableImagesDirKeepsEverything: an images dir that exists but cannot be listed is not
// an empty dir. Nothing is unpinned, the kubelet's filter still keeps every image, and the error
// names the dir. (Root reads a mode-000 dir, so the dir is made a file: listing it fails the same
// way, ENOTDIR instead of EACCES.)
func TestUnreadableImagesDirKeepsEverything(t *testing.T) {
	containerdtest.RequireRoot(t)
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	a := n.agent(nil)
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	moved := n.imagesDir + ".moved"
	if err := os.Rename(n.imagesDir, moved); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(n.imagesDir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	err := a.Sync(n.ctx).Err()
	if err == nil || !strings.Contains(err.Error(), n.imagesDir) {
		t.Errorf("sync error %v does not name the images dir", err)
	}
	if present, pinned := n.criPinned("acc.example/app:1.0"); !present || !pinned {
		t.Errorf("app:1.0 with the images dir unreadable: present=%t pinned=%t", present, pinned)
	}
	if !a.Keeper().Keep("", []string{"acc.example/app:1.0"}, nil) {
		t.Error("the GC filter no longer keeps app:1.0")
	}
	os.Remove(n.imagesDir)
	if err := os.Rename(moved, n.imagesDir); err != nil {
		t.Fatal(err)
	}
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
}
