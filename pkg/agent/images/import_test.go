package images_test

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	containerdimages "github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/platforms"
	"github.com/containerd/typeurl/v2"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// archiveCase is one archive of the images dir: a format in one compression.
type archiveCase struct {
	file string
	oci  bool
	refs []string // tags it provides
}

func writeArchive(t testing.TB, dir string, c archiveCase) {
	t.Helper()
	path := filepath.Join(dir, c.file)
	if c.oci {
		entries := map[string]any{}
		for i, ref := range c.refs {
			if i == 0 {
				img, err := imagetest.Image(64<<10, imagetest.Amd64)
				if err != nil {
					t.Fatal(err)
				}
				entries[ref] = img
				continue
			}
			idx, err := imagetest.MultiPlatform(32<<10, imagetest.Amd64, v1.Platform{OS: "linux", Architecture: "arm64"})
			if err != nil {
				t.Fatal(err)
			}
			entries[ref] = idx
		}
		if err := imagetest.WriteOCI(path, entries); err != nil {
			t.Fatal(err)
		}
		return
	}
	tags := map[string]v1.Image{}
	for _, ref := range c.refs {
		img, err := imagetest.Image(64<<10, imagetest.Amd64)
		if err != nil {
			t.Fatal(err)
		}
		tags[ref] = img
	}
	if err := imagetest.WriteDocker(path, tags); err != nil {
		t.Fatal(err)
	}
}

// everyFormat is every tarball ending k3s loads, in both formats; OCI archives also carry a
// multi-platform index.
func everyFormat() []archiveCase {
	var cases []archiveCase
	for _, ext := range imagetest.Extensions {
		tag := strings.NewReplacer(".", "").Replace(ext)
		cases = append(cases,
			archiveCase{file: "docker" + ext, refs: []string{"acc.example/docker-" + tag + ":1.0", "acc.example/docker-" + tag + "-b:2.0"}},
			archiveCase{file: "oci" + ext, oci: true, refs: []string{"acc.example/oci-" + tag + ":1.0", "acc.example/oci-" + tag + "-multi:1.0"}},
		)
	}
	return cases
}

func TestSyncPinsEveryReferenceOfEveryFormat(t *testing.T) {
	n := newNode(t)
	cases := everyFormat()
	for _, c := range cases {
		writeArchive(t, n.imagesDir, c)
	}
	report := n.agent(nil).Sync(n.ctx)
	if err := report.Err(); err != nil {
		t.Fatalf("sync: %v", err)
	}
	if len(report.Archives) != len(cases) {
		t.Fatalf("sync processed %d archives, want %d", len(report.Archives), len(cases))
	}
	for _, a := range report.Archives {
		if !a.Imported {
			t.Errorf("%s: not imported on first sync", a.Archive.Name())
		}
		var tags, digests int
		for _, r := range a.Refs {
			if strings.Contains(r.Ref, "@sha256:") {
				digests++
			} else {
				tags++
			}
			present, pinned := n.criPinned(r.Ref)
			if !present || !pinned {
				t.Errorf("%s: %s present=%t pinned=%t by CRI ImageStatus, want both", a.Archive.Name(), r.Ref, present, pinned)
			}
			if src := n.labels(r.Ref)[pinning.LabelSource]; src != a.Archive.Name() {
				t.Errorf("%s: source label %q, want %q", r.Ref, src, a.Archive.Name())
			}
		}
		if tags != 2 || digests != 2 {
			t.Errorf("%s: %d tag and %d digest references, want 2 and 2", a.Archive.Name(), tags, digests)
		}
	}
	// The multi-platform image must be usable on this node: its config for linux/amd64 is there.
	img, err := n.client.GetImage(n.ctx, "acc.example/oci-tar-multi:1.0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := img.Config(n.ctx); err != nil {
		t.Errorf("multi-platform image has no usable linux/amd64 config: %v", err)
	}

	// A second sync with unchanged archives imports nothing and changes nothing.
	again := n.agent(nil).Sync(n.ctx)
	if err := again.Err(); err != nil {
		t.Fatal(err)
	}
	for _, a := range again.Archives {
		if a.Imported {
			t.Errorf("%s imported again although unchanged", a.Archive.Name())
		}
		for _, r := range a.Refs {
			if r.Result != pinning.AlreadyOurs {
				t.Errorf("second sync: %s: %s, want %s", r.Ref, r.Result, pinning.AlreadyOurs)
			}
		}
	}
}

func TestPinIsSetAtCreation(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar.zst", refs: []string{"acc.example/app:1.0", "acc.example/web:2.0"}})
	writeArchive(t, n.imagesDir, archiveCase{file: "oci.tar", oci: true, refs: []string{"acc.example/oci:1.0"}})

	events, errs := n.client.Subscribe(n.ctx, `topic=="/images/create"`, `topic=="/images/update"`)
	report := n.agent(nil).Sync(n.ctx)
	if err := report.Err(); err != nil {
		t.Fatal(err)
	}
	wantCreated := map[string]bool{}
	for _, a := range report.Archives {
		for _, r := range a.Refs {
			wantCreated[r.Ref] = true
		}
	}
	timeout := time.After(10 * time.Second)
	for len(wantCreated) > 0 {
		select {
		case env := <-events:
			ev, err := typeurl.UnmarshalAny(env.Event)
			if err != nil {
				t.Fatal(err)
			}
			switch e := ev.(type) {
			case *eventstypes.ImageCreate:
				if !wantCreated[e.Name] {
					continue
				}
				delete(wantCreated, e.Name)
				if e.Labels[pinning.LabelPinned] != pinning.PinnedValue || e.Labels[pinning.LabelSource] == "" {
					t.Errorf("create event of %s carries labels %v: not pinned at creation", e.Name, e.Labels)
				}
			case *eventstypes.ImageUpdate:
				if wantCreated[e.Name] {
					t.Errorf("%s was updated before it was created pinned", e.Name)
				}
			}
		case err := <-errs:
			t.Fatal(err)
		case <-timeout:
			t.Fatalf("no create event for %v", wantCreated)
		}
	}
}

// ctrImport imports an archive by hand, as `k3s ctr images import` does, with no pin.
func (n *node) ctrImport(path string) {
	n.t.Helper()
	out, err := exec.Command(n.daemon.Bin.Ctr, "-a", n.daemon.Address, "-n", "k8s.io", "images", "import", path).CombinedOutput()
	if err != nil {
		n.t.Fatalf("ctr images import %s: %v\n%s", path, err, out)
	}
}

func TestPolicyPinsHandImports(t *testing.T) {
	n := newNode(t)
	hand := t.TempDir()
	writeArchive(t, hand, archiveCase{file: "hand.tar", refs: []string{"registry.local/team/tool:1.0", "registry.local/team/tool:2.0", "other.example/unmatched:1.0"}})
	n.ctrImport(filepath.Join(hand, "hand.tar"))
	writeArchive(t, hand, archiveCase{file: "labelled.tar", refs: []string{"other.example/labelled:1.0"}})
	n.ctrImport(filepath.Join(hand, "labelled.tar"))
	img, err := n.client.ImageService().Get(n.ctx, "other.example/labelled:1.0")
	if err != nil {
		t.Fatal(err)
	}
	img.Labels = map[string]string{"example.com/keep": "yes"}
	if _, err := n.client.ImageService().Update(n.ctx, img, "labels.example.com/keep"); err != nil {
		t.Fatal(err)
	}

	policy, err := pinning.NewPolicy([]string{"registry.local/team/*"}, []string{"example.com/keep=yes"})
	if err != nil {
		t.Fatal(err)
	}
	report := n.agent(policy).Sync(n.ctx)
	if err := report.Err(); err != nil {
		t.Fatal(err)
	}
	for ref, want := range map[string]bool{
		"registry.local/team/tool:1.0": true,
		"registry.local/team/tool:2.0": true,
		"other.example/labelled:1.0":   true,
		"other.example/unmatched:1.0":  false,
	} {
		present, pinned := n.criPinned(ref)
		if !present || pinned != want {
			t.Errorf("%s: present=%t pinned=%t, want pinned=%t", ref, present, pinned, want)
		}
		if want && n.labels(ref)[pinning.LabelSource] != pinning.SourcePolicy {
			t.Errorf("%s: source label %q, want %q", ref, n.labels(ref)[pinning.LabelSource], pinning.SourcePolicy)
		}
	}
}

func TestUserPinStaysTheirs(t *testing.T) {
	n := newNode(t)
	hand := t.TempDir()
	writeArchive(t, hand, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	n.ctrImport(filepath.Join(hand, "app.tar"))
	img, err := n.client.ImageService().Get(n.ctx, "acc.example/app:1.0")
	if err != nil {
		t.Fatal(err)
	}
	img.Labels = map[string]string{pinning.LabelPinned: pinning.PinnedValue, "user": "mine"}
	if _, err := n.client.ImageService().Update(n.ctx, img, "labels."+pinning.LabelPinned, "labels.user"); err != nil {
		t.Fatal(err)
	}
	// The same archive then lands in the images dir.
	if err := os.Rename(filepath.Join(hand, "app.tar"), filepath.Join(n.imagesDir, "app.tar")); err != nil {
		t.Fatal(err)
	}
	if err := n.agent(nil).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	labels := n.labels("acc.example/app:1.0")
	if _, ours := labels[pinning.LabelSource]; ours || labels["user"] != "mine" || !pinning.IsPinned(labels) {
		t.Errorf("user's pinned reference now has labels %v; want their pin and label kept and not claimed", labels)
	}
	err = pinning.NewPinner(n.client.ImageService()).Unpin(n.ctx, "acc.example/app:1.0")
	if err == nil || !strings.Contains(err.Error(), pinning.ErrNotOurs.Error()) {
		t.Errorf("Unpin of a user's pin: err=%v, want ErrNotOurs", err)
	}
	if !pinning.IsPinned(n.labels("acc.example/app:1.0")) {
		t.Error("user's pin was removed")
	}
}

func TestBadArchivesDoNotStopOthers(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "a-good.tar.gz", refs: []string{"acc.example/good:1.0"}})
	writeArchive(t, n.imagesDir, archiveCase{file: "z-good.tar", oci: true, refs: []string{"acc.example/good-oci:1.0"}})
	if err := n.agent(nil).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// Break things around the good archives.
	writeArchive(t, n.imagesDir, archiveCase{file: "truncated.tar", refs: []string{"acc.example/truncated:1.0"}})
	truncate(t, filepath.Join(n.imagesDir, "truncated.tar"), 0.5)
	if err := os.WriteFile(filepath.Join(n.imagesDir, "corrupt.tar.gz"), []byte("\x1f\x8b\x08\x00 this is not gzip"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(n.imagesDir, "notes.zip"), []byte("PK"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(n.imagesDir, "list.txt"), []byte("# comment\n\nnot a ref!!\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	report := n.agent(nil).Sync(n.ctx)
	err := report.Err()
	if err == nil {
		t.Fatal("sync succeeded over bad archives")
	}
	for _, want := range []string{"truncated.tar", "corrupt.tar.gz", "notes.zip", "list.txt:3"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("sync error does not name %s:\n%v", want, err)
		}
	}
	for _, ref := range []string{"acc.example/good:1.0", "acc.example/good-oci:1.0"} {
		if present, pinned := n.criPinned(ref); !present || !pinned {
			t.Errorf("%s: present=%t pinned=%t after sync over bad archives", ref, present, pinned)
		}
	}
}

func truncate(t *testing.T, path string, fraction float64) {
	t.Helper()
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, int64(float64(info.Size())*fraction)); err != nil {
		t.Fatal(err)
	}
}

func TestAirgapExtraRegistryRetags(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/team/app:1.0"}})
	a := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, ExtraRegistries: []string{"mirror.local:5000"}})
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if present, pinned := n.criPinned("mirror.local:5000/team/app:1.0"); !present || !pinned {
		t.Errorf("retag: present=%t pinned=%t", present, pinned)
	}
}

// TestSharedReferencePassesToTheNextArchive: two archives provide the same image. The pin records
// the first by name; when it leaves, the pin passes to the second, and when that leaves too, the
// pin goes. No pin is left behind owned by an archive that is gone.
func TestSharedReferencePassesToTheNextArchive(t *testing.T) {
	n := newNode(t)
	img, err := imagetest.Image(32<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	ref := "acc.example/shared:1.0"
	for _, f := range []string{"a.tar", "b.tar.gz"} {
		if err := imagetest.WriteDocker(filepath.Join(n.imagesDir, f), map[string]v1.Image{ref: img}); err != nil {
			t.Fatal(err)
		}
	}
	a := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir})
	sync := func() {
		t.Helper()
		if err := a.Sync(n.ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	sync()
	if src := n.labels(ref)[pinning.LabelSource]; src != "a.tar" {
		t.Fatalf("source %q, want a.tar (first by name)", src)
	}
	os.Remove(filepath.Join(n.imagesDir, "a.tar"))
	sync()
	if l := n.labels(ref); !pinning.IsPinned(l) || l[pinning.LabelSource] != "b.tar.gz" {
		t.Errorf("after a.tar left: labels %v, want pinned for b.tar.gz", l)
	}
	os.Remove(filepath.Join(n.imagesDir, "b.tar.gz"))
	sync()
	if l := n.labels(ref); pinning.IsPinned(l) || l[pinning.LabelSource] != "" {
		t.Errorf("after both left: labels %v, want no pin of ours", l)
	}
}

// TestTouchedArchiveIsNotImportedAgain: `touch` on an archive (what users do to make k3s look at
// it again) changes its mtime only; the agent sees the same content and changes nothing.
func TestTouchedArchiveIsNotImportedAgain(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar.zst", refs: []string{"acc.example/app:1.0"}})
	a := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir})
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(filepath.Join(n.imagesDir, "app.tar.zst"), later, later); err != nil {
		t.Fatal(err)
	}
	report := a.Sync(n.ctx)
	if err := report.Err(); err != nil {
		t.Fatal(err)
	}
	for _, r := range report.Archives[0].Refs {
		if report.Archives[0].Imported || r.Result != pinning.AlreadyOurs {
			t.Errorf("touched archive: imported=%t, %s %s", report.Archives[0].Imported, r.Ref, r.Result)
		}
	}
}

// TestTouchedAfterAFirstSyncIsNotImported: a first sync records no digest of an archive (it reads
// only the index; nothing to compare with yet), whether it imported the archive (a cold sync) or
// found every image present (a new state on a loaded store). Touched afterwards, uncompressed or
// compressed, the archive is read once, its images found present, nothing imported, and the
// digest airgap.Read gives recorded; touched again, the digests match and its record stands.
func TestTouchedAfterAFirstSyncIsNotImported(t *testing.T) {
	n := newNode(t)
	files := []archiveCase{
		{file: "plain.tar", refs: []string{"acc.example/plain:1.0"}},
		{file: "gz.tar.gz", oci: true, refs: []string{"acc.example/gz:1.0"}},
		{file: "zst.tar.zst", refs: []string{"acc.example/zst:1.0"}},
	}
	want := map[string]digest.Digest{}
	for _, c := range files {
		writeArchive(t, n.imagesDir, c)
		a, err := airgap.At(filepath.Join(n.imagesDir, c.file))
		if err != nil {
			t.Fatal(err)
		}
		if _, want[c.file], err = airgap.ReadFile(a); err != nil {
			t.Fatal(err)
		}
	}
	for _, step := range []struct {
		what     string
		imported bool
	}{{"a cold sync", true}, {"a first sync on a store that holds every image", false}} {
		state := filepath.Join(t.TempDir(), "state.json")
		report := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, StateFile: state}).Sync(n.ctx)
		if err := report.Err(); err != nil {
			t.Fatal(err)
		}
		for _, ar := range report.Archives {
			if ar.Imported != step.imported {
				t.Errorf("%s: %s imported=%t, want %t", step.what, ar.Archive.Name(), ar.Imported, step.imported)
			}
		}
		recorded := func(when string, digest func(name string) digest.Digest) {
			t.Helper()
			st, err := statefile.Load(state)
			if err != nil {
				t.Fatal(err)
			}
			for name := range want {
				if rec := st.Archives[name]; rec == nil || rec.Digest != digest(name) || len(rec.Images) != 1 {
					t.Errorf("%s, %s: %s recorded %+v, want digest %q and its image", step.what, when, name, rec, digest(name))
				}
			}
		}
		recorded("first", func(string) digest.Digest { return "" })
		for round, when := range []string{"touched", "touched again"} {
			later := time.Now().Add(time.Duration(round+1) * time.Hour)
			for name := range want {
				if err := os.Chtimes(filepath.Join(n.imagesDir, name), later, later); err != nil {
					t.Fatal(err)
				}
			}
			report = images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, StateFile: state}).Sync(n.ctx)
			if err := report.Err(); err != nil {
				t.Fatal(err)
			}
			for _, ar := range report.Archives {
				for _, r := range ar.Refs {
					if ar.Imported || r.Result != pinning.AlreadyOurs {
						t.Errorf("%s, %s: %s imported=%t, %s %s", step.what, when, ar.Archive.Name(), ar.Imported, r.Ref, r.Result)
					}
				}
			}
			recorded(when, func(name string) digest.Digest { return want[name] })
		}
	}
}

// TestReferenceMadeBesideAPresentOneIsWhole: a reference the store lacks beside one it holds (a
// deleted repo@digest) is made again without an import, pointing at the target exactly as
// containerd's import wrote it for the name beside it, annotations too: the sync's list keeps
// targets without them (imagelist.Record), and a reference made from it must not be poorer.
func TestReferenceMadeBesideAPresentOneIsWhole(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	if err := n.agent(nil).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	store := n.client.ImageService()
	tag, err := store.Get(n.ctx, "acc.example/app:1.0")
	if err != nil {
		t.Fatal(err)
	}
	if len(tag.Target.Annotations) == 0 {
		t.Fatalf("containerd's import wrote no annotations on %s's target: nothing to compare", tag.Name)
	}
	byDigest := "acc.example/app@" + tag.Target.Digest.String()
	if err := store.Delete(n.ctx, byDigest, containerdimages.SynchronousDelete()); err != nil {
		t.Fatal(err)
	}
	report := n.agent(nil).Sync(n.ctx)
	if err := report.Err(); err != nil {
		t.Fatal(err)
	}
	if report.Archives[0].Imported {
		t.Fatal("the archive was imported again: the reference was not made beside the present one")
	}
	made, err := store.Get(n.ctx, byDigest)
	if err != nil {
		t.Fatalf("%s not made again: %v", byDigest, err)
	}
	if !reflect.DeepEqual(made.Target, tag.Target) {
		t.Errorf("%s made with target %+v, want %s's %+v", byDigest, made.Target, tag.Name, tag.Target)
	}
}

// TestNamesAreMadeAsTheCRIMarksThem: a load makes each name with the CRI's mark, and the image's
// ID record (sha256:<config digest>) as the CRI makes it, so that the CRI has nothing to write
// after the load (it updated every name made without its mark, a transaction each): the ID record
// on the image's target, with the mark and nothing else, and the CRI lists the image by that ID,
// pinned, under its names; again after containerd restarts (the CRI reads its images from the
// records then). A docker archive and an OCI archive of two platforms.
func TestNamesAreMadeAsTheCRIMarksThem(t *testing.T) {
	n := newNode(t)
	refs := []string{"acc.example/app:1.0", "acc.example/multi:1.0"}
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: refs[:1]})
	writeArchive(t, n.imagesDir, archiveCase{file: "multi.tar", oci: true, refs: refs[1:]})
	if err := n.agent(nil).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	store := n.client.ImageService()
	marked := map[string]string{pinning.LabelCRIManaged: pinning.CRIManagedValue}
	check := func(when string) {
		t.Helper()
		for _, ref := range refs {
			tag, err := store.Get(n.ctx, ref)
			if err != nil {
				t.Fatalf("%s: %v", when, err)
			}
			config, err := containerdimages.Config(n.ctx, n.client.ContentStore(), tag.Target, platforms.Default())
			if err != nil {
				t.Fatalf("%s: config of %s: %v", when, ref, err)
			}
			id, err := store.Get(n.ctx, config.Digest.String())
			if err != nil {
				t.Errorf("%s: %s: no image ID record %s: %v", when, ref, config.Digest, err)
			} else if !maps.Equal(id.Labels, marked) || id.Target.Digest != tag.Target.Digest {
				t.Errorf("%s: %s: ID record %s labelled %v on %s, want %v on %s", when, ref, id.Name, id.Labels, id.Target.Digest, marked, tag.Target.Digest)
			}
			for _, name := range []string{ref, strings.Split(ref, ":")[0] + "@" + tag.Target.Digest.String()} {
				if l := n.labels(name); l[pinning.LabelCRIManaged] != pinning.CRIManagedValue || !pinning.IsPinned(l) {
					t.Errorf("%s: %s labelled %v: not made as the CRI marks a name, or not pinned", when, name, l)
				}
			}
			n.await(10*time.Second, when+": the CRI lists "+ref+" by its image ID, pinned", func() bool {
				resp, err := n.cri.ImageStatus(n.ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
				img := resp.GetImage()
				return err == nil && img != nil && img.Id == config.Digest.String() && img.Pinned && slices.Contains(img.RepoTags, ref)
			})
		}
	}
	check("after the load")
	if err := n.daemon.Restart(n.ctx); err != nil {
		t.Fatal(err)
	}
	check("after containerd restarted")
}

// TestImageIDRecordFollowsTheLastManifestMade: one image (one config) in two archives under two
// manifests (a docker archive, whose manifest containerd writes at import, and an OCI archive
// with an OCI manifest), the second added later: its names are made with the CRI's mark, so the
// CRI does not touch the image ID record; the load points the record at the manifest it made,
// as the CRI does when it records a name, and the CRI lists both names under the one image ID.
func TestImageIDRecordFollowsTheLastManifestMade(t *testing.T) {
	n := newNode(t)
	img, err := imagetest.Image(64<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	one, two := "acc.example/one:1.0", "acc.example/two:1.0"
	if err := imagetest.WriteDocker(filepath.Join(n.imagesDir, "a.tar"), map[string]v1.Image{one: img}); err != nil {
		t.Fatal(err)
	}
	if err := n.agent(nil).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := imagetest.WriteOCI(filepath.Join(n.imagesDir, "b.tar"), map[string]any{two: mutate.MediaType(img, types.OCIManifestSchema1)}); err != nil {
		t.Fatal(err)
	}
	if err := n.agent(nil).Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	config, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	first, second := n.target(one), n.target(two)
	if first == "" || first == second {
		t.Fatalf("%s on %q, %s on %q: not two manifests", one, first, two, second)
	}
	if got := n.target(config.String()); got != second {
		t.Errorf("image ID record %s on %s, want %s's manifest %s", config, got, two, second)
	}
	for _, ref := range []string{one, two} {
		n.await(10*time.Second, "the CRI lists "+ref+" as image "+config.String()+", pinned", func() bool {
			resp, err := n.cri.ImageStatus(n.ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
			img := resp.GetImage()
			return err == nil && img != nil && img.Id == config.String() && img.Pinned
		})
	}
}

// TestImportLeavesNoStreamsOpen: a load gives back every gRPC stream it opened. containerd's
// content client leaves each written blob's stream open until its context ends, and gRPC keeps a
// goroutine and the stream's buffers for each; inside k3s the agent's context never ends, so a
// cold load of 10,000 references kept tens of thousands of them for the life of the process.
// The goroutines of this test process come back to where they were before the load.
func TestImportLeavesNoStreamsOpen(t *testing.T) {
	n := newNode(t)
	for i, oci := range []bool{false, true, false, true} {
		writeArchive(t, n.imagesDir, archiveCase{file: fmt.Sprintf("a%d.tar", i), oci: oci,
			refs: []string{fmt.Sprintf("streams.example/a%d:1", i), fmt.Sprintf("streams.example/a%d:2", i), fmt.Sprintf("streams.example/a%d:3", i)}})
	}
	if _, err := n.client.Version(n.ctx); err != nil { // the connection's own goroutines, started
		t.Fatal(err)
	}
	before := runtime.NumGoroutine()
	report := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir}).Sync(n.ctx)
	if err := report.Err(); err != nil {
		t.Fatal(err)
	}
	imported := 0
	for _, a := range report.Archives {
		if a.Imported {
			imported++
		}
	}
	if imported != 4 {
		t.Fatalf("%d of 4 archives imported", imported)
	}
	var after int
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if after = runtime.NumGoroutine(); after <= before+2 || time.Now().After(deadline) {
			break
		}
	}
	if after > before+2 {
		var stacks strings.Builder
		pprof.Lookup("goroutine").WriteTo(&stacks, 1)
		t.Errorf("%d goroutines before the load of 4 archives (12 images), %d after it:\n%s", before, after, firstBytes(stacks.String(), 3000))
	}
}

func firstBytes(s string, n int) string {
	if len(s) > n {
		return s[:n] + "\n..."
	}
	return s
}

// TestCtrExportedArchiveIsLoaded: k3s's own air-gap tarball is written by `ctr images export`
// (containerd's archive.Export: an OCI layout, docker's manifest.json beside it, directory
// entries), so it takes the layout's path (importLayout). Exported from one node and loaded on
// another, each image is there, pinned, at the same manifest, and whole after containerd's GC has
// run to its end (what no image's GC labels reach is gone then).
func TestCtrExportedArchiveIsLoaded(t *testing.T) {
	refs := []string{"acc.example/exported:1.0", "acc.example/exported-two:2.0"}
	src := newNode(t)
	writeArchive(t, src.imagesDir, archiveCase{file: "a.tar", refs: refs[:1]})
	writeArchive(t, src.imagesDir, archiveCase{file: "b.tar", oci: true, refs: refs[1:]})
	if err := src.agent(nil).Sync(src.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	dst := newNode(t)
	path := filepath.Join(dst.imagesDir, "k3s-airgap-images-amd64.tar")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	opts := []archive.ExportOpt{archive.WithPlatform(platforms.DefaultStrict())}
	for _, ref := range refs {
		opts = append(opts, archive.WithImage(src.client.ImageService(), ref))
	}
	err = archive.Export(src.ctx, src.client.ContentStore(), f, opts...)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, e := range readTarEntries(t, path) {
		names[e.hdr.Name] = true
	}
	if !names["oci-layout"] || !names["manifest.json"] {
		t.Fatalf("the export holds %v; want an OCI layout with docker's manifest.json beside it", names)
	}

	if err := dst.agent(nil).Sync(dst.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	dst.collectGarbage()
	for _, ref := range refs {
		want, err := src.client.ImageService().Get(src.ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		got, err := dst.client.ImageService().Get(dst.ctx, ref)
		if err != nil {
			t.Fatalf("%s from the exported archive: %v", ref, err)
		}
		if got.Target.Digest != want.Target.Digest {
			t.Errorf("%s: target %s; want the exporting node's %s", ref, got.Target.Digest, want.Target.Digest)
		}
		if _, _, _, missing, err := containerdimages.Check(dst.ctx, dst.client.ContentStore(), got.Target, platforms.Default()); err != nil || len(missing) > 0 {
			t.Errorf("%s after containerd's GC: %d blobs missing (%v); want it whole", ref, len(missing), err)
		}
		if present, pinned := dst.criPinned(ref); !present || !pinned {
			t.Errorf("%s: present=%t pinned=%t; want it pinned", ref, present, pinned)
		}
	}
}
