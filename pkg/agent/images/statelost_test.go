package images_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/k3s-pinning/k3s-pinning/internal/filelock"
	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// The ways a state file is lost: each leaves the file (or its absence) as the next agent finds it.
var stateLosses = []struct {
	name   string
	damage func(t *testing.T, path string)
	// unreadable: the file is there and is not a state this version reads: it must be kept aside.
	unreadable bool
}{
	{"corrupt", func(t *testing.T, path string) { writeFile(t, path, "{not json") }, true},
	{"truncated", func(t *testing.T, path string) { writeFile(t, path, "") }, true},
	{"newer-version", func(t *testing.T, path string) { writeFile(t, path, `{"version": 2, "archives": {}}`) }, true},
	{"removed", func(t *testing.T, path string) {
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
	}, false},
}

// withStateLock calls f holding the lock the agent's saves of state take turns on.
func withStateLock(t *testing.T, state string, f func()) {
	t.Helper()
	lock, err := os.OpenFile(filepath.Join(filepath.Dir(state), ".state.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := filelock.Lock(lock); err != nil {
		t.Fatal(err)
	}
	f()
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// retainedNode is a node whose apps.tar was loaded, then removed with
// --retain-removed-archive-images: its references stay pinned, recorded as retained in state.
func retainedNode(t *testing.T) (n *node, state string, refs []string) {
	t.Helper()
	n = newNode(t)
	tag := "acc.example/app:1.0"
	writeArchive(t, n.imagesDir, archiveCase{file: "apps.tar", refs: []string{tag}})
	writeArchive(t, n.imagesDir, archiveCase{file: "other.tar", refs: []string{"acc.example/other:1.0"}})
	state = filepath.Join(t.TempDir(), "state.json")
	a := agentimages.NewAgent(agentimages.Services(n.client), retainingConfig(n, state, nil))
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	refs = []string{tag, "acc.example/app@" + n.target(tag)}
	if err := os.Remove(filepath.Join(n.imagesDir, "apps.tar")); err != nil {
		t.Fatal(err)
	}
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if s, err := statefile.Load(state); err != nil || s.Retained["apps.tar"] == nil {
		t.Fatalf("apps.tar not retained in %s (%v)", state, err)
	}
	return n, state, refs
}

func retainingConfig(n *node, state string, rec agentimages.Reporter) agentimages.Config {
	return agentimages.PolicyValues{RetainRemovedArchiveImages: true}.AgentConfig(agentimages.Config{ImagesDir: n.imagesDir, StateFile: state, Reporter: rec})
}

// assertRetained checks that refs are pinned for apps.tar, that the CRI reports them pinned, and
// that the state file on disk retains them again.
func assertRetained(t *testing.T, n *node, state string, refs []string) {
	t.Helper()
	for _, ref := range refs {
		if present, pinned := n.criPinned(ref); !present || !pinned {
			t.Errorf("%s: present=%t pinned=%t in the CRI, want pinned: the state file's loss unpinned it", ref, present, pinned)
		}
		if src := n.labels(ref)[pinning.LabelSource]; src != "apps.tar" {
			t.Errorf("%s: pinned for %q, want apps.tar", ref, src)
		}
	}
	s, err := statefile.Load(state)
	if err != nil {
		t.Fatalf("the state file was not written again: %v", err)
	}
	for _, ref := range refs {
		if s.Retained["apps.tar"] == nil || s.Retained["apps.tar"].Refs[ref] == "" {
			t.Errorf("%s not retained for apps.tar in the state written again: %+v", ref, s.Retained)
		}
	}
}

// assertKeptAside checks that the damaged file is beside state with the bytes it had.
func assertKeptAside(t *testing.T, state string, damaged []byte) {
	t.Helper()
	aside := statefile.SetAsideFiles(state)
	if len(aside) != 1 {
		t.Fatalf("kept aside: %v, want the one damaged file", aside)
	}
	if got, err := os.ReadFile(aside[0]); err != nil || !bytes.Equal(got, damaged) {
		t.Errorf("%s holds %q (%v), want the damaged file's %q", aside[0], got, err, damaged)
	}
}

// TestLostStateFileKeepsRetainedImages: the state file deleted, truncated, corrupt or written by a
// newer version while no agent runs; the next agent unpins nothing that a removed archive
// retained, reads the retained references back from the pins in containerd (status shows them
// retained), keeps the unreadable file aside and says so in an Event; `unpin` then lets the image
// go, every name of it.
func TestLostStateFileKeepsRetainedImages(t *testing.T) {
	for _, loss := range stateLosses {
		t.Run(loss.name, func(t *testing.T) {
			n, state, refs := retainedNode(t)
			loss.damage(t, state)
			damaged, _ := os.ReadFile(state)

			rec := &recorder{}
			a := agentimages.NewAgent(agentimages.Services(n.client), retainingConfig(n, state, rec))
			before, err := a.Inspect(n.ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range before.Refs {
				if r.Ref == refs[0] && (!r.Retained || !r.Wanted) {
					t.Errorf("status before the sync: %+v, want retained and wanted", r)
				}
			}
			if loss.unreadable != (before.StateUnreadable != "") {
				t.Errorf("status before the sync: state unreadable %q", before.StateUnreadable)
			}
			if err := a.Sync(n.ctx).Err(); err != nil {
				t.Fatal(err)
			}
			assertRetained(t, n, state, refs)
			if !n.pinnedLabel("acc.example/other:1.0") {
				t.Error("other.tar's image is not pinned")
			}
			if _, ok := rec.event(agentimages.ReasonStateRebuilt, "apps.tar"); !ok {
				t.Errorf("no %s Event naming apps.tar: %+v", agentimages.ReasonStateRebuilt, rec.events)
			}
			if loss.unreadable {
				assertKeptAside(t, state, damaged)
				if _, ok := rec.event(agentimages.ReasonStateFileUnreadable, state); !ok {
					t.Errorf("no %s Event naming %s: %+v", agentimages.ReasonStateFileUnreadable, state, rec.events)
				}
			} else if aside := statefile.SetAsideFiles(state); len(aside) != 0 {
				t.Errorf("kept aside %v, with no file to keep", aside)
			}
			snap, err := a.Inspect(n.ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, r := range snap.Refs {
				if r.Ref == refs[0] && (!r.Retained || !r.Wanted || !r.Pinned) {
					t.Errorf("status row of %s: %+v, want retained, wanted, pinned", r.Ref, r)
				}
			}
			if loss.unreadable && (snap.StateUnreadable != "" || len(snap.StateSetAside) != 1) {
				t.Errorf("status after the sync: unreadable %q, kept aside %v", snap.StateUnreadable, snap.StateSetAside)
			}

			// A restart on the rebuilt file keeps them, and `unpin` of the tag lets the image go.
			b := agentimages.NewAgent(agentimages.Services(n.client), retainingConfig(n, state, nil))
			if err := b.Sync(n.ctx).Err(); err != nil {
				t.Fatal(err)
			}
			assertRetained(t, n, state, refs)
			cli := agentimages.NewAgent(agentimages.Services(n.client), agentimages.Config{ImagesDir: n.imagesDir, StateFile: state})
			if _, err := cli.UnpinManual(n.ctx, refs[0]); err != nil {
				t.Fatal(err)
			}
			if err := b.Sync(n.ctx).Err(); err != nil {
				t.Fatal(err)
			}
			for _, ref := range refs {
				if n.pinnedLabel(ref) {
					t.Errorf("%s still pinned after unpin", ref)
				}
			}
		})
	}
}

// TestStateFileLostWhileRunning: the state file of a running agent damaged or deleted; the agent's
// next saves unpin nothing it retained and write the file again from memory, the damaged one kept
// aside.
func TestStateFileLostWhileRunning(t *testing.T) {
	for _, loss := range stateLosses {
		t.Run(loss.name, func(t *testing.T) {
			n, state, refs := retainedNode(t)
			rec := &recorder{}
			started := time.Now()
			a := n.runWith(retainingConfig(n, state, rec))
			n.await(10*time.Second, "the running agent's first save", func() bool {
				s, err := statefile.Load(state)
				return err == nil && s.Agent.LastReconcile.After(started)
			})
			// In a turn of the writers' lock: a save of the agent under way would otherwise rename its
			// own file over the damage (seen beside a k3s build).
			var damaged []byte
			withStateLock(t, state, func() {
				loss.damage(t, state)
				damaged, _ = os.ReadFile(state)
			})
			if err := a.Sync(n.ctx).Err(); err != nil {
				t.Fatal(err)
			}
			assertRetained(t, n, state, refs)
			if loss.unreadable {
				assertKeptAside(t, state, damaged)
				if _, ok := rec.event(agentimages.ReasonStateFileUnreadable, state); !ok {
					t.Errorf("no %s Event naming %s", agentimages.ReasonStateFileUnreadable, state)
				}
			}
		})
	}
}

// TestUnpinWithUnreadableStateRefuses: `unpin` of an image a removed archive may have retained,
// while the state file cannot be read, unpins nothing and says what to do; an image whose archive
// is in the images dir is unpinned all the same.
func TestUnpinWithUnreadableStateRefuses(t *testing.T) {
	n, state, refs := retainedNode(t)
	writeFile(t, state, "{not json")
	cli := agentimages.NewAgent(agentimages.Services(n.client), agentimages.Config{ImagesDir: n.imagesDir, StateFile: state})
	if _, err := cli.UnpinManual(n.ctx, refs[0]); err == nil {
		t.Fatal("unpin of a retained image with an unreadable state file succeeded")
	} else {
		t.Logf("unpin: %v", err)
	}
	for _, ref := range refs {
		if !n.pinnedLabel(ref) {
			t.Errorf("%s unpinned although the state file could not be read", ref)
		}
	}
	if got, _ := os.ReadFile(state); string(got) != "{not json" {
		t.Errorf("unpin wrote the unreadable state file: %q", got)
	}
	other := "acc.example/other:1.0" // its archive is in the images dir: not retained
	if _, err := cli.UnpinManual(n.ctx, other); err != nil {
		t.Fatalf("unpin of %s: %v", other, err)
	}
	if n.pinnedLabel(other) {
		t.Errorf("%s still pinned", other)
	}
}
