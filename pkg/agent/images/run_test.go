package images_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// runAgent runs the long-running agent on n until the test ends, and waits for its first sync.
func (n *node) runAgent(stateFile string, wantPinned ...string) {
	n.t.Helper()
	n.runWith(agentimages.Config{StateFile: stateFile})
	for _, ref := range wantPinned {
		n.await(10*time.Second, ref+" pinned by the first sync", func() bool { return n.pinnedLabel(ref) })
	}
}

// runWith runs an agent with cfg on the node's images dir and containerd (restore on, the
// periodic reconcile out of the way) until the test ends; Run's error fails the test.
func (n *node) runWith(cfg agentimages.Config) *agentimages.Agent {
	n.t.Helper()
	a, stop := n.startAgent(cfg, agentimages.RunOptions{Restore: true, ReconcileInterval: time.Hour})
	n.t.Cleanup(stop)
	return a
}

// startAgent runs an agent on the node's images dir until stop, which waits for Run to end: a
// test that restarts the agent on the same state file stops the first one itself.
func (n *node) startAgent(cfg agentimages.Config, opts agentimages.RunOptions) (a *agentimages.Agent, stop func()) {
	cfg.ImagesDir = n.imagesDir
	a = agentimages.NewAgent(agentimages.Services(n.client), cfg)
	ctx, cancel := context.WithCancel(n.ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, opts) }()
	return a, func() {
		cancel()
		if err := <-done; err != nil {
			n.t.Errorf("Run: %v", err)
		}
	}
}

// await polls cond until it holds or d passes, and returns how long it took.
func (n *node) await(d time.Duration, what string, cond func() bool) time.Duration {
	n.t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			n.t.Fatalf("not within %s: %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

func (n *node) pinnedLabel(ref string) bool {
	img, err := n.client.ImageService().Get(n.ctx, ref)
	return err == nil && pinning.IsPinned(img.Labels)
}

func (n *node) target(ref string) string {
	img, err := n.client.ImageService().Get(n.ctx, ref)
	if err != nil {
		return ""
	}
	return img.Target.Digest.String()
}

// setLabel sets (or with value "" removes) one label, as `ctr images label` does.
func (n *node) setLabel(ref, key, value string) {
	n.t.Helper()
	if _, err := n.client.ImageService().Update(n.ctx, images.Image{Name: ref, Labels: map[string]string{key: value}}, "labels."+key); err != nil {
		n.t.Fatalf("label %s %s=%s: %v", ref, key, value, err)
	}
}

func TestRunRepinsStrippedLabelWithinOneSecond(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	n.runAgent("", "acc.example/app:1.0")
	n.setLabel("acc.example/app:1.0", pinning.LabelPinned, "")
	took := n.await(time.Second, "re-pinned after the label was stripped", func() bool { return n.pinnedLabel("acc.example/app:1.0") })
	t.Logf("re-pinned %s after the strip", took)
	if _, pinned := n.criPinned("acc.example/app:1.0"); !pinned {
		t.Error("CRI does not report the re-pinned image as pinned")
	}
}

// k3s clears io.cri-containerd.pinned from every image carrying io.cattle.k3s.pinned at each start,
// then re-imports. Replay exactly that removal.
func TestRunKeepsPinsThroughK3sLabelClearing(t *testing.T) {
	n := newNode(t)
	refs := []string{"acc.example/app-a:1", "acc.example/app-b:1"}
	writeArchive(t, n.imagesDir, archiveCase{file: "k3s.tar.zst", refs: refs})
	n.runAgent("", refs...)
	for _, ref := range refs {
		n.setLabel(ref, pinning.LabelK3sPinned, "pinned") // as k3s labels what it imports
	}
	all, err := n.client.ImageService().List(n.ctx, `labels."`+pinning.LabelK3sPinned+`"`)
	if err != nil || len(all) < len(refs) {
		t.Fatalf("images carrying the k3s label: %d, %v", len(all), err)
	}
	for _, img := range all {
		n.setLabel(img.Name, pinning.LabelPinned, "")
	}
	for _, ref := range refs {
		n.await(time.Second, ref+" pinned again after k3s cleared it", func() bool { return n.pinnedLabel(ref) })
	}
}

func TestRunRestoresDeletedImageWithSameDigest(t *testing.T) {
	n := newNode(t)
	ref := "acc.example/app:1.0"
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar.gz", refs: []string{ref}})
	stateFile := filepath.Join(t.TempDir(), "state.json")
	n.runAgent(stateFile, ref)
	want := n.target(ref)
	// The CRI learns of images from containerd's events: a RemoveImage before it has seen this one
	// would delete nothing (and the restore below would pass vacuously).
	if present, _ := n.criPinned(ref); !present {
		t.Fatalf("the CRI does not list %s", ref)
	}

	// The CRI RemoveImage call, as crictl rmi and the kubelet make it: every reference goes.
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}}); err != nil {
		t.Fatal(err)
	}
	took := n.await(5*time.Second, ref+" restored after CRI RemoveImage", func() bool { return n.pinnedLabel(ref) })
	t.Logf("restored %s after CRI RemoveImage", took)
	if got := n.target(ref); got != want {
		t.Errorf("restored digest %s, recorded %s", got, want)
	}
	if present, pinned := n.criPinned(ref); !present || !pinned {
		t.Errorf("after restore: CRI present=%t pinned=%t", present, pinned)
	}
	// What status and doctor read, in other processes: the restore done, nothing left pending.
	var view statefile.RunStatus
	deadline := time.Now().Add(3 * time.Second)
	for {
		st, err := statefile.Load(stateFile)
		if view = st.Agent; err == nil && view.RestoresDone >= 1 && len(view.RestoresPending) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the state file after the restore: %+v (%v), want a restore done and none pending", view, err)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// The same with `ctr images rm`, which deletes one reference.
	out, err := exec.Command(n.daemon.Bin.Ctr, "-a", n.daemon.Address, "-n", "k8s.io", "images", "rm", ref).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images rm: %v\n%s", err, out)
	}
	n.await(5*time.Second, ref+" restored after ctr images rm", func() bool { return n.pinnedLabel(ref) })
	if got := n.target(ref); got != want {
		t.Errorf("restored digest %s, recorded %s", got, want)
	}
}

func TestRunUnpinsWhenArchiveLeaves(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "leaving.tar", refs: []string{"acc.example/leaving:1.0"}})
	writeArchive(t, n.imagesDir, archiveCase{file: "staying.tar", refs: []string{"acc.example/staying:1.0"}})
	hand := t.TempDir()
	writeArchive(t, hand, archiveCase{file: "hand.tar", refs: []string{"hand.example/mine:1.0"}})
	n.ctrImport(filepath.Join(hand, "hand.tar"))
	n.setLabel("hand.example/mine:1.0", pinning.LabelPinned, pinning.PinnedValue) // the user's own pin
	n.runAgent("", "acc.example/leaving:1.0", "acc.example/staying:1.0")
	// The sync creates the repo@digest name a moment after the tag: waited for, or the removal
	// below would check nothing for it.
	digestRef := ""
	n.await(5*time.Second, "acc.example/leaving@sha256:... pinned by the first sync", func() bool {
		all, err := n.client.ImageService().List(n.ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, img := range all {
			if strings.HasPrefix(img.Name, "acc.example/leaving@") {
				digestRef = img.Name
			}
		}
		return digestRef != "" && n.pinnedLabel(digestRef)
	})

	if err := os.Remove(filepath.Join(n.imagesDir, "leaving.tar")); err != nil {
		t.Fatal(err)
	}
	n.await(5*time.Second, "references of the removed archive unpinned", func() bool {
		return !n.pinnedLabel("acc.example/leaving:1.0") && !n.pinnedLabel(digestRef)
	})
	if n.target("acc.example/leaving:1.0") == "" {
		t.Error("the image of the removed archive was deleted; it must stay for the kubelet to collect")
	}
	if !n.pinnedLabel("acc.example/staying:1.0") || !n.pinnedLabel("hand.example/mine:1.0") {
		t.Error("unpinning touched another archive's or the user's pin")
	}
}

func TestRunFollowsReplacedArchive(t *testing.T) {
	n := newNode(t)
	ref := "acc.example/app:1.0"
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{ref}})
	n.runAgent("", ref)
	old := n.target(ref)
	oldDigestRef := "acc.example/app@" + old

	// Replace it under the same name, as an upgrade does (write aside, rename over).
	tmp := t.TempDir()
	writeArchive(t, tmp, archiveCase{file: "app.tar", refs: []string{ref}})
	if err := os.Rename(filepath.Join(tmp, "app.tar"), filepath.Join(n.imagesDir, "app.tar")); err != nil {
		t.Fatal(err)
	}
	n.await(10*time.Second, "new content imported", func() bool { return n.target(ref) != old && n.pinnedLabel(ref) })
	n.await(5*time.Second, "old digest reference unpinned", func() bool { return !n.pinnedLabel(oldDigestRef) })
	if n.target(oldDigestRef) == "" {
		t.Error("old image deleted; it must only be unpinned")
	}
	if !n.pinnedLabel("acc.example/app@" + n.target(ref)) {
		t.Error("new digest reference not pinned")
	}
}

func TestRestartWithUnchangedArchivesImportsNothing(t *testing.T) {
	n := newNode(t)
	state := filepath.Join(t.TempDir(), "state", "state.json")
	for _, c := range everyFormat()[:6] {
		writeArchive(t, n.imagesDir, c)
	}
	first := agentimages.NewAgent(agentimages.Services(n.client), agentimages.Config{ImagesDir: n.imagesDir, StateFile: state})
	if err := first.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(state); err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("state file: %v, mode %v; want 0600", err, info)
	}
	if info, err := os.Stat(filepath.Dir(state)); err != nil || info.Mode().Perm() != 0o700 {
		t.Fatalf("state dir: %v, mode %v; want 0700 (the agent created it)", err, info)
	}
	// k3s restarts clear the pins of what it imported: strip every pin, then restart the agent.
	all, _ := n.client.ImageService().List(n.ctx)
	for _, img := range all {
		if pinning.IsPinned(img.Labels) {
			n.setLabel(img.Name, pinning.LabelPinned, "")
		}
	}
	for name, corrupt := range map[string]bool{"restart": false, "restart with a corrupt state file": true} {
		if corrupt {
			os.WriteFile(state, []byte("{not json"), 0o600)
		}
		report := agentimages.NewAgent(agentimages.Services(n.client), agentimages.Config{ImagesDir: n.imagesDir, StateFile: state}).Sync(n.ctx)
		if err := report.Err(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		imports := 0
		for _, a := range report.Archives {
			if a.Imported {
				imports++
			}
			for _, r := range a.Refs {
				if !n.pinnedLabel(r.Ref) {
					t.Errorf("%s: %s not pinned", name, r.Ref)
				}
			}
		}
		if imports != 0 {
			t.Errorf("%s: %d archives imported again, want 0", name, imports)
		}
	}
}

func TestRunReconnectsAfterContainerdRestart(t *testing.T) {
	n := newNode(t)
	ref := "acc.example/app:1.0"
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{ref}})
	n.runAgent("", ref)
	if err := n.daemon.Restart(n.ctx); err != nil {
		t.Fatal(err)
	}
	// Protection resumes within 10 s of containerd coming back.
	n.await(10*time.Second, "label stripped after the restart is re-pinned", func() bool {
		img, err := n.client.ImageService().Get(n.ctx, ref)
		if err != nil {
			return false
		}
		if pinning.IsPinned(img.Labels) {
			n.setLabel(ref, pinning.LabelPinned, "")
			time.Sleep(300 * time.Millisecond)
			return n.pinnedLabel(ref)
		}
		return false
	})
}

// mountTmpfs mounts a small tmpfs at a new dir, unmounted when the test ends.
func mountTmpfs(t *testing.T, opts string) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, opts); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

func TestUnwritableStateKeepsProtectingFromMemory(t *testing.T) {
	n := newNode(t)
	full := mountTmpfs(t, "size=16k")
	filler, _ := os.Create(filepath.Join(full, "filler"))
	for {
		if _, err := filler.Write(make([]byte, 4096)); err != nil {
			break // ENOSPC: the disk is full, as when the kubelet is collecting images
		}
	}
	filler.Close()
	readOnly := mountTmpfs(t, "size=16k")
	if err := syscall.Mount("", readOnly, "", syscall.MS_REMOUNT|syscall.MS_RDONLY, ""); err != nil {
		t.Fatalf("remount read-only: %v", err)
	}
	for name, dir := range map[string]string{"full": full, "read-only": readOnly} {
		ref := "acc.example/" + name + ":1.0"
		writeArchive(t, n.imagesDir, archiveCase{file: name + ".tar", refs: []string{ref}})
		a := agentimages.NewAgent(agentimages.Services(n.client), agentimages.Config{ImagesDir: n.imagesDir, StateFile: filepath.Join(dir, "state.json")})
		if err := a.Sync(n.ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if !n.pinnedLabel(ref) {
			t.Errorf("%s state dir: %s not pinned", name, ref)
		}
		want := map[string]string{"full": "no space left", "read-only": "read-only file system"}[name]
		if v := a.View(); !strings.Contains(v.StateError, want) {
			t.Errorf("%s state dir: agent view reports %q, want it to say %q", name, v.StateError, want)
		}
	}
}

// TestFailedImportKeepsTheArchivesOtherPins: an image deleted while the disk holding containerd's
// root is full cannot be imported again; the archive's other references must stay pinned (the
// soak found them unpinned: a failed import was recorded as the archive providing nothing), and
// once space is freed the next sync brings the image back.
func TestFailedImportKeepsTheArchivesOtherPins(t *testing.T) {
	containerdtest.RequireRoot(t)
	root := t.TempDir()
	if err := syscall.Mount("tmpfs", root, "tmpfs", 0, "size=48m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(root, syscall.MNT_DETACH) }) // after containerd stops (LIFO)
	n := newNodeWith(t, containerdtest.Options{Root: root})
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app-a:1.0", "acc.example/app-b:1.0"}})
	a := n.agent(nil)
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	cs := n.client.ContentStore()
	var blobs []ocispec.Descriptor
	appA, err := n.client.ImageService().Get(n.ctx, "acc.example/app-a:1.0")
	if err != nil {
		t.Fatal(err)
	}
	if err := images.Walk(n.ctx, images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
		blobs = append(blobs, desc)
		return images.Children(ctx, cs, desc)
	}), appA.Target); err != nil {
		t.Fatal(err)
	}
	// The CRI removes the names it knows of, and learns of the sync's from containerd's events: on
	// a loaded machine (containerd 1.7, 2-5 runs in 40) it did not know the digest reference yet,
	// which then kept the content, and the sync below had nothing to import.
	n.await(10*time.Second, "the CRI listing app-a:1.0 by its digest", func() bool {
		st, err := n.cri.ImageStatus(n.ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: "acc.example/app-a:1.0"}})
		return err == nil && st.Image != nil && len(st.Image.RepoDigests) > 0
	})
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: "acc.example/app-a:1.0"}}); err != nil {
		t.Fatal(err)
	}
	n.await(10*time.Second, "containerd's GC deleting the content of app-a:1.0", func() bool {
		for _, b := range blobs {
			if _, err := cs.Info(n.ctx, b.Digest); err == nil {
				return false
			}
		}
		return true
	})
	var st syscall.Statfs_t
	if err := syscall.Statfs(root, &st); err != nil {
		t.Fatal(err)
	}
	filler, err := os.Create(filepath.Join(root, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()
	if err := syscall.Fallocate(int(filler.Fd()), 0, 0, int64(st.Bavail)*int64(st.Bsize)-16<<10); err != nil {
		t.Fatal(err)
	}
	err = a.Sync(n.ctx).Err()
	if err == nil || !strings.Contains(err.Error(), "no space left") {
		t.Fatalf("sync on a full disk: %v, want no space left", err)
	}
	if present, pinned := n.criPinned("acc.example/app-b:1.0"); !present || !pinned {
		t.Errorf("b:1.0 after a failed import of its archive: present=%t pinned=%t", present, pinned)
	}
	filler.Close()
	os.Remove(filler.Name())
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"acc.example/app-a:1.0", "acc.example/app-b:1.0"} {
		if present, pinned := n.criPinned(ref); !present || !pinned {
			t.Errorf("%s once space is back: present=%t pinned=%t", ref, present, pinned)
		}
	}
}

// TestStalePinsOfAnArchiveAreReleased: a pin an archive set on what it no longer provides is
// released at the next sync, however its release was missed (the soak's violation: a digest
// reference of an archive's previous content left pinned with that archive as its source, which
// nothing released once the state no longer said the archive had provided it). Here the agent is
// down while the archive is replaced, and its state file is lost meanwhile: the new agent has no
// record to compare with, only the pins in containerd and the archive as it is now. Removed
// instead, the archive cannot be read again: the agent cannot tell a release it missed from an
// archive it retained, so it keeps the pins, retained, until `unpin`.
func TestStalePinsOfAnArchiveAreReleased(t *testing.T) {
	for _, replaced := range []bool{true, false} {
		name := map[bool]string{true: "replaced", false: "removed"}[replaced]
		t.Run(name, func(t *testing.T) {
			n := newNode(t)
			ref := "acc.example/app:1.0"
			writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{ref}})
			writeArchive(t, n.imagesDir, archiveCase{file: "other.tar", refs: []string{"acc.example/other:1.0"}})
			state := filepath.Join(t.TempDir(), "state.json")
			cfg := agentimages.Config{ImagesDir: n.imagesDir, StateFile: state}
			if err := agentimages.NewAgent(agentimages.Services(n.client), cfg).Sync(n.ctx).Err(); err != nil {
				t.Fatal(err)
			}
			old := n.target(ref)
			oldDigestRef := "acc.example/app@" + old
			if !n.pinnedLabel(oldDigestRef) {
				t.Fatalf("%s not pinned by the first sync", oldDigestRef)
			}

			// While no agent runs: the archive replaced (or removed), the state lost.
			if replaced {
				tmp := t.TempDir()
				writeArchive(t, tmp, archiveCase{file: "app.tar", refs: []string{ref}})
				if err := os.Rename(filepath.Join(tmp, "app.tar"), filepath.Join(n.imagesDir, "app.tar")); err != nil {
					t.Fatal(err)
				}
			} else if err := os.Remove(filepath.Join(n.imagesDir, "app.tar")); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(state); err != nil {
				t.Fatal(err)
			}
			if err := agentimages.NewAgent(agentimages.Services(n.client), cfg).Sync(n.ctx).Err(); err != nil {
				t.Fatal(err)
			}

			if n.target(oldDigestRef) == "" {
				t.Errorf("%s was deleted; it must only be unpinned, for the kubelet to collect", oldDigestRef)
			}
			if !replaced {
				s, _ := statefile.Load(state)
				for _, r := range []string{ref, oldDigestRef} {
					if !n.pinnedLabel(r) || s.Retained["app.tar"] == nil || s.Retained["app.tar"].Refs[r] == "" {
						t.Errorf("%s: pinned %t, retained for app.tar %t: the agent cannot tell why it is pinned and must keep it", r, n.pinnedLabel(r), s.Retained["app.tar"] != nil)
					}
				}
			} else if n.pinnedLabel(oldDigestRef) {
				img, _ := n.client.ImageService().Get(n.ctx, oldDigestRef)
				t.Errorf("%s, which app.tar no longer provides, is still pinned: %v", oldDigestRef, img.Labels)
			}
			if replaced {
				if n.target(ref) == old || !n.pinnedLabel(ref) || !n.pinnedLabel("acc.example/app@"+n.target(ref)) {
					t.Errorf("the new content of app.tar is not what %s is, pinned with its digest reference", ref)
				}
			}
			if !n.pinnedLabel("acc.example/other:1.0") {
				t.Error("another archive's pin was released")
			}
		})
	}
}
