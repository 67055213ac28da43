package images_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// recorder is a Reporter that keeps what it is told.
type recorder struct {
	mu          sync.Mutex
	events      []agentimages.Event
	protections []agentimages.Protection
}

func (r *recorder) Event(e agentimages.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *recorder) Protection(p agentimages.Protection) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.protections = append(r.protections, p)
}

// event is the first event with reason whose message names what, if any.
func (r *recorder) event(reason, what string) (agentimages.Event, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.events {
		if e.Reason == reason && strings.Contains(e.Message, what) {
			return e, true
		}
	}
	return agentimages.Event{}, false
}

func (r *recorder) count(reason string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, e := range r.events {
		if e.Reason == reason {
			n++
		}
	}
	return n
}

func (r *recorder) last() (agentimages.Protection, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.protections) == 0 {
		return agentimages.Protection{}, 0
	}
	return r.protections[len(r.protections)-1], len(r.protections)
}

// TestRunReportsEventsAndProtection: on a real containerd, what an operator sees of the node
// through a Reporter: a restore, a loss, an archive that fails, a misspelled pin label, each as
// an event once, and the protection flipping to unprotected and back.
func TestRunReportsEventsAndProtection(t *testing.T) {
	n := newNode(t)
	app, hand := "acc.example/app:1.0", "acc.example/hand:1.0"
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{app}})
	// A hand import the policy wants: nothing in the images dir can bring it back.
	handTar := filepath.Join(t.TempDir(), "hand.tar")
	writeArchive(t, filepath.Dir(handTar), archiveCase{file: "hand.tar", refs: []string{hand}})
	n.ctrImport(handTar)
	policy, err := pinning.NewPolicy([]string{"acc.example/hand"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	a := agentimages.NewAgent(agentimages.Services(n.client), agentimages.Config{ImagesDir: n.imagesDir, Policy: policy, Reporter: rec})
	ctx, cancel := context.WithCancel(n.ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, agentimages.RunOptions{Restore: true, ReconcileInterval: time.Hour}) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	n.await(10*time.Second, "the first sync pins both", func() bool { return n.pinnedLabel(app) && n.pinnedLabel(hand) })
	n.await(5*time.Second, "a protection reported", func() bool { _, k := rec.last(); return k > 0 })
	if p, _ := rec.last(); !p.Protected() || p.Wanted == 0 {
		t.Fatalf("after the first sync: %+v (%s), want protected", p, p.Summary())
	}
	if present, _ := n.criPinned(app); !present {
		t.Fatalf("the CRI does not list %s", app)
	}

	// A restore: the image is deleted through the CRI and comes back; one event says so.
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: app}}); err != nil {
		t.Fatal(err)
	}
	n.await(5*time.Second, "an ImageRestored event naming "+app, func() bool { _, ok := rec.event(agentimages.ReasonImageRestored, app); return ok })
	if e, _ := rec.event(agentimages.ReasonImageRestored, app); e.Warning || !strings.Contains(e.Message, "app.tar") {
		t.Errorf("restore event %+v: want a Normal event naming the archive", e)
	}
	n.await(5*time.Second, "protected again after the restore", func() bool { p, _ := rec.last(); return p.Protected() })

	// A loss: the hand import is deleted and nothing provides it.
	if out, err := exec.Command(n.daemon.Bin.Ctr, "-a", n.daemon.Address, "-n", "k8s.io", "images", "rm", hand).CombinedOutput(); err != nil {
		t.Fatalf("ctr images rm: %v\n%s", err, out)
	}
	n.await(5*time.Second, "an ImageLost event naming "+hand, func() bool { _, ok := rec.event(agentimages.ReasonImageLost, hand); return ok })
	if e, _ := rec.event(agentimages.ReasonImageLost, hand); !e.Warning {
		t.Errorf("loss event %+v: want a Warning", e)
	}
	n.await(5*time.Second, "unprotected, naming "+hand, func() bool {
		p, _ := rec.last()
		return !p.Protected() && slices.Contains(p.Lost, hand) && slices.Contains(p.Missing, hand)
	})
	if p, _ := rec.last(); !strings.Contains(p.Summary(), hand) {
		t.Errorf("summary %q does not name %s", p.Summary(), hand)
	}
	// Imported again by hand: protected again, and pinned (the policy wants it).
	n.ctrImport(handTar)
	n.await(5*time.Second, "protected after the hand import came back", func() bool { p, _ := rec.last(); return p.Protected() })
	n.await(5*time.Second, hand+" pinned again", func() bool { return n.pinnedLabel(hand) })

	// A bad archive and a misspelled pin label, seen by the next sync (the new file triggers it);
	// the sync after that reports neither again.
	n.setLabel(app, "io.cri.containerd.pinned", "pinned")
	if err := os.WriteFile(filepath.Join(n.imagesDir, "broken.tar"), []byte("not a tar archive"), 0o644); err != nil {
		t.Fatal(err)
	}
	n.await(10*time.Second, "an ArchiveLoadFailed event naming broken.tar", func() bool { _, ok := rec.event(agentimages.ReasonArchiveLoadFailed, "broken.tar"); return ok })
	n.await(5*time.Second, "a MisspelledPinLabel event naming "+app, func() bool { _, ok := rec.event(agentimages.ReasonMisspelledPinLabel, app); return ok })
	n.await(5*time.Second, "unprotected, naming broken.tar", func() bool { p, _ := rec.last(); return p.FailedArchives["broken.tar"] != "" })
	writeArchive(t, n.imagesDir, archiveCase{file: "other.tar", refs: []string{"acc.example/other:1.0"}})
	n.await(10*time.Second, "the next sync pins other.tar's image", func() bool { return n.pinnedLabel("acc.example/other:1.0") })
	if got := rec.count(agentimages.ReasonArchiveLoadFailed); got != 1 {
		t.Errorf("%d ArchiveLoadFailed events after two syncs, want 1", got)
	}
	if got := rec.count(agentimages.ReasonMisspelledPinLabel); got != 1 {
		t.Errorf("%d MisspelledPinLabel events after two syncs, want 1", got)
	}
	if err := os.Remove(filepath.Join(n.imagesDir, "broken.tar")); err != nil {
		t.Fatal(err)
	}
	n.await(10*time.Second, "protected once broken.tar is gone", func() bool { p, _ := rec.last(); return p.Protected() })
}

// TestWorkloadImagesArePinnedAndReleased: on a real containerd, the images the cluster's
// workloads reference are pinned (as "workload") and kept by the kubelet's filter; a pin set for
// a workload that is gone is released, while another owner's pin on a workload image is never
// touched; before the workloads are known, workload pins stay.
func TestWorkloadImagesArePinnedAndReleased(t *testing.T) {
	n := newNode(t)
	dir := t.TempDir()
	refs := []string{"acc.example/web:1.0", "acc.example/batch:2.0", "acc.example/theirs:1.0"}
	for i, ref := range refs {
		file := []string{"web.tar", "batch.tar", "theirs.tar"}[i]
		writeArchive(t, dir, archiveCase{file: file, refs: []string{ref}})
		n.ctrImport(filepath.Join(dir, file))
	}
	n.setLabel("acc.example/theirs:1.0", pinning.LabelPinned, pinning.PinnedValue) // not ours
	state := filepath.Join(t.TempDir(), "state.json")
	start := func() (*agentimages.Agent, func()) {
		return n.startAgent(agentimages.Config{StateFile: state, FetchMaxDiskUsage: anyDiskUsage}, agentimages.RunOptions{ReconcileInterval: time.Hour})
	}
	a, stop := start()
	// As pod specs write them: short names too (docker.io/library/... is not used here).
	a.SetWorkloadImages(namedByWorkloads("acc.example/web:1.0", "acc.example/batch:2.0", "acc.example/theirs:1.0", "not a reference"))
	for _, ref := range refs[:2] {
		n.await(10*time.Second, ref+" pinned for its workload", func() bool { return n.pinnedLabel(ref) })
		if src, _ := pinning.OwnPin(n.labels(ref)); src != pinning.SourceWorkload {
			t.Errorf("%s pinned with source %q, want %q", ref, src, pinning.SourceWorkload)
		}
	}
	// The filter's keep-set is published at the end of the sync that set the pins: a moment after
	// them (seen: a check right after the pins, on a loaded machine, came first).
	n.await(10*time.Second, "the kubelet's filter keeping a workload's image", func() bool {
		return a.Keeper().Keep("sha256:none", []string{"acc.example/web:1.0"}, nil)
	})
	// The batch workload is deleted: its pin goes; theirs is not ours to remove.
	a.SetWorkloadImages(namedByWorkloads("acc.example/web:1.0"))
	n.await(10*time.Second, "batch:2.0 released", func() bool { return !n.pinnedLabel("acc.example/batch:2.0") })
	time.Sleep(200 * time.Millisecond)
	if !n.pinnedLabel("acc.example/theirs:1.0") {
		t.Errorf("another owner's pin was removed")
	}
	if !n.pinnedLabel("acc.example/web:1.0") {
		t.Errorf("web:1.0, still referenced, lost its pin")
	}
	n.await(10*time.Second, "the filter no longer keeping batch:2.0", func() bool {
		return !a.Keeper().Keep("sha256:none", []string{"acc.example/batch:2.0"}, nil)
	})
	stop()

	// A restart that has not heard from the cluster yet keeps web's pin (nothing on a guess).
	a, stop = start()
	defer stop()
	time.Sleep(time.Second)
	if !n.pinnedLabel("acc.example/web:1.0") {
		t.Fatalf("a restart released a workload pin before the workloads were known")
	}
	if !a.Keeper().Keep("sha256:none", []string{"acc.example/web:1.0"}, nil) {
		t.Errorf("before the workloads are known, the filter does not keep web:1.0")
	}
	a.SetWorkloadImages(namedByWorkloads()) // every workload gone
	n.await(10*time.Second, "web:1.0 released once no workload references it", func() bool { return !n.pinnedLabel("acc.example/web:1.0") })
}

// TestLostThatNothingWantsIsNotMissing: a workload's image deleted with nothing to restore it
// from is lost and leaves the node unprotected; once no workload names it, nothing wants it, and
// the node is protected again (it stayed missing for ever before).
func TestLostThatNothingWantsIsNotMissing(t *testing.T) {
	n := newNode(t)
	hand := "acc.example/job:1.0"
	handTar := filepath.Join(t.TempDir(), "job.tar")
	writeArchive(t, filepath.Dir(handTar), archiveCase{file: "job.tar", refs: []string{hand}})
	n.ctrImport(handTar)
	rec := &recorder{}
	a := n.runWith(agentimages.Config{Reporter: rec, FetchMaxDiskUsage: anyDiskUsage})
	a.SetWorkloadImages(namedByWorkloads(hand))
	n.await(10*time.Second, hand+" pinned for its workload", func() bool { return n.pinnedLabel(hand) })
	if out, err := exec.Command(n.daemon.Bin.Ctr, "-a", n.daemon.Address, "-n", "k8s.io", "images", "rm", hand).CombinedOutput(); err != nil {
		t.Fatalf("ctr images rm: %v\n%s", err, out)
	}
	n.await(5*time.Second, "unprotected, "+hand+" lost", func() bool { p, _ := rec.last(); return slices.Contains(p.Lost, hand) })
	a.SetWorkloadImages(namedByWorkloads())
	n.await(10*time.Second, "protected once no workload names it", func() bool { p, _ := rec.last(); return p.Protected() })
}
