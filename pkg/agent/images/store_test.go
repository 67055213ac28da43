package images_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	ctrimages "github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/metadata"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/plugins/content/local"
	bolt "go.etcd.io/bbolt"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// store is containerd's own metadata store (bolt) and content store, opened in a temp dir
// without a daemon and without root: the agent's logic on the same code a daemon runs, reached
// through the interfaces the agent takes instead of gRPC. No CRI and no events: lists and Run's
// event handling are tested on the real daemon (node).
type store struct {
	ctx       context.Context
	cd        images.Containerd
	imagesDir string
}

func newStore(t testing.TB) *store {
	t.Helper()
	dir := t.TempDir()
	cs, err := local.NewStore(filepath.Join(dir, "content"))
	if err != nil {
		t.Fatal(err)
	}
	bdb, err := bolt.Open(filepath.Join(dir, "meta.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bdb.Close() })
	db := metadata.NewDB(bdb, cs, nil)
	ctx, cancel := context.WithTimeout(namespaces.WithNamespace(context.Background(), pinning.DefaultNamespace), 2*time.Minute)
	t.Cleanup(cancel)
	if err := db.Init(ctx); err != nil {
		t.Fatal(err)
	}
	imagesDir := filepath.Join(dir, "images")
	if err := os.MkdirAll(imagesDir, 0o755); err != nil {
		t.Fatal(err)
	}
	return &store{ctx: ctx, imagesDir: imagesDir,
		cd: images.Containerd{Images: metadata.NewImageStore(db), Content: db.ContentStore(), Leases: metadata.NewLeaseManager(db)}}
}

// pins are the references of the store and the source of our pin on each ("-" for a pin we did
// not set, "" for none).
func (s *store) pins(t *testing.T) map[string]string {
	t.Helper()
	all, err := s.cd.Images.List(s.ctx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, img := range all {
		switch pinning.OwnerOf(img.Labels) {
		case pinning.OurPin:
			out[img.Name] = img.Labels[pinning.LabelSource]
		case pinning.TheirPin:
			out[img.Name] = "-"
		default:
			out[img.Name] = ""
		}
	}
	return out
}

// TestAgentOnContainerdsStore: the agent's whole reconcile on containerd's metadata store, no
// daemon: every reference of every archive created pinned for its archive, nothing imported
// again by a second sync, a reference two archives provide passing to the other when the first
// leaves, a user's pin never touched, and the keep-decision (Keeper) following it all.
func TestAgentOnContainerdsStore(t *testing.T) {
	s := newStore(t)
	writeArchive(t, s.imagesDir, archiveCase{file: "a.tar", refs: []string{"acc.example/app:1.0", "acc.example/only-a:1.0"}})
	writeArchive(t, s.imagesDir, archiveCase{file: "b.tar.zst", oci: true, refs: []string{"acc.example/oci:1.0"}})
	agent := images.NewAgent(s.cd, images.Config{ImagesDir: s.imagesDir})
	report := agent.Sync(s.ctx)
	if err := report.Err(); err != nil {
		t.Fatal(err)
	}
	pins := s.pins(t)
	for ref, want := range map[string]string{"acc.example/app:1.0": "a.tar", "acc.example/only-a:1.0": "a.tar", "acc.example/oci:1.0": "b.tar.zst"} {
		if pins[ref] != want {
			t.Errorf("%s pinned for %q, want %q (all: %v)", ref, pins[ref], want, pins)
		}
	}
	digestRefs := 0
	for ref, src := range pins {
		// The image ID records (sha256:<config digest>) are made as the CRI makes them: unpinned.
		if src == "" && !strings.HasPrefix(ref, "sha256:") {
			t.Errorf("%s exists unpinned", ref)
		}
		if src != "" && strings.Contains(ref, "@sha256:") {
			digestRefs++
		}
	}
	if digestRefs != 3 {
		t.Errorf("%d repo@digest references, want one per image (3): %v", digestRefs, pins)
	}
	if again := agent.Sync(s.ctx); again.Err() != nil || slices.ContainsFunc(again.Archives, func(a images.ArchiveReport) bool { return a.Imported }) {
		t.Errorf("second sync imported again or failed: %+v", again)
	}

	// A user's pin on what an archive also provides stays theirs through everything below.
	if _, err := s.cd.Images.Update(s.ctx, imageNamed(t, s, "acc.example/only-a:1.0", map[string]string{pinning.LabelPinned: pinning.PinnedValue}), "labels."+pinning.LabelSource); err != nil {
		t.Fatal(err)
	}
	// b.tar.zst now also provides app:1.0 (the same image: a copy of a.tar) and a.tar leaves.
	writeArchive(t, s.imagesDir, archiveCase{file: "b.tar.zst", oci: true, refs: []string{"acc.example/oci:1.0"}})
	data, err := os.ReadFile(filepath.Join(s.imagesDir, "a.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.imagesDir, "c.tar"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := agent.Sync(s.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(s.imagesDir, "a.tar")); err != nil {
		t.Fatal(err)
	}
	if err := agent.Sync(s.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	pins = s.pins(t)
	if pins["acc.example/app:1.0"] != "c.tar" {
		t.Errorf("after a.tar left, app:1.0 pinned for %q, want c.tar, which provides it too", pins["acc.example/app:1.0"])
	}
	if pins["acc.example/only-a:1.0"] != "-" {
		t.Errorf("the user's pin on only-a:1.0 became %q", pins["acc.example/only-a:1.0"])
	}
	keeper := agent.Keeper()
	if !keeper.Keep("sha256:none", []string{"acc.example/app:1.0"}, nil) || !keeper.Keep("sha256:none", []string{"acc.example/oci:1.0"}, nil) {
		t.Error("the Keeper does not keep what the images dir provides")
	}

	// Everything leaves: our pins go, the user's stays, the images stay for the kubelet to collect.
	for _, f := range []string{"b.tar.zst", "c.tar"} {
		os.Remove(filepath.Join(s.imagesDir, f))
	}
	if err := agent.Sync(s.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for ref, src := range s.pins(t) {
		if src != "" && !(ref == "acc.example/only-a:1.0" && src == "-") {
			t.Errorf("%s still pinned for %q after every archive left", ref, src)
		}
	}
	if keeper.Keep("sha256:none", []string{"acc.example/app:1.0"}, nil) {
		t.Error("the Keeper still keeps app:1.0 after every archive left")
	}
}

// TestManualPinsOnContainerdsStore: a manual pin is ours and wanted until unpinned; unpin names
// what still wants a reference, and refuses a pin we did not set.
func TestManualPinsOnContainerdsStore(t *testing.T) {
	s := newStore(t)
	writeArchive(t, s.imagesDir, archiveCase{file: "a.tar", refs: []string{"acc.example/app:1.0"}})
	agent := images.NewAgent(s.cd, images.Config{ImagesDir: s.imagesDir})
	if err := agent.Sync(s.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// A hand import: the same image under another name, not pinned.
	if _, err := s.cd.Images.Create(s.ctx, imageNamed(t, s, "acc.example/app:1.0", nil, "acc.example/hand:1")); err != nil {
		t.Fatal(err)
	}
	if res, err := agent.PinManual(s.ctx, "acc.example/hand:1"); err != nil || res != pinning.Pinned {
		t.Fatalf("pin: %v %v", res, err)
	}
	snap, err := agent.Inspect(s.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(snap.Refs, func(r images.RefStatus) bool { return r.Ref == "acc.example/hand:1" }); i < 0 || !snap.Refs[i].Wanted || snap.Refs[i].Source != pinning.SourceManual {
		t.Errorf("hand:1 in the snapshot: %+v", snap.Refs)
	}
	if by, err := agent.UnpinManual(s.ctx, "acc.example/app:1.0"); err != nil || by != "a.tar" {
		t.Errorf("unpin app:1.0: wanted by %q, %v; want a.tar", by, err)
	}
	if by, err := agent.UnpinManual(s.ctx, "acc.example/hand:1"); err != nil || by != "" {
		t.Errorf("unpin hand:1: wanted by %q, %v", by, err)
	}
	if _, err := s.cd.Images.Update(s.ctx, imageNamed(t, s, "acc.example/hand:1", map[string]string{pinning.LabelPinned: pinning.PinnedValue}), "labels."+pinning.LabelPinned); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.UnpinManual(s.ctx, "acc.example/hand:1"); !errors.Is(err, pinning.ErrNotOurs) {
		t.Errorf("unpin of a pin we did not set: %v, want ErrNotOurs", err)
	}
}

// imageNamed is the image ref names in the store, with labels, renamed to rename[0] if given.
func imageNamed(t *testing.T, s *store, ref string, labels map[string]string, rename ...string) ctrimages.Image {
	t.Helper()
	img, err := s.cd.Images.Get(s.ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	img.Labels = labels
	if len(rename) > 0 {
		img.Name = rename[0]
	}
	return img
}

// TestRunCallsAfterSyncAfterTheSync: the standalone daemon's hook (it hands the sync's transient
// memory back to the system) runs once the first sync has pinned what the images dir provides,
// and outside the agent's lock (the hook may ask the agent anything).
func TestRunCallsAfterSyncAfterTheSync(t *testing.T) {
	s := newStore(t)
	ref := "acc.example/app:1.0"
	writeArchive(t, s.imagesDir, archiveCase{file: "app.tar", refs: []string{ref}})
	a := images.NewAgent(s.cd, images.Config{ImagesDir: s.imagesDir})
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	pinsAtHook := make(chan map[string]string, 1)
	done := make(chan error, 1)
	go func() {
		done <- a.Run(ctx, images.RunOptions{ReconcileInterval: time.Hour, AfterSync: func() {
			a.View() // takes the agent's lock: a hook called under it would never return
			select {
			case pinsAtHook <- s.pins(t):
			default:
			}
		}})
	}()
	select {
	case pins := <-pinsAtHook:
		if pins[ref] != "app.tar" {
			t.Errorf("at the hook: pins %v, want %s pinned for app.tar", pins, ref)
		}
	case err := <-done:
		t.Fatalf("Run returned before the hook: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("AfterSync was not called within 30 s of the start")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
