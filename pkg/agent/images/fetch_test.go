package images_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// peer is a registry on loopback standing in for the cluster's other nodes (k3s's embedded
// registry serves what their containerd holds, by digest, as a registry does).
type peer struct {
	host string
}

func newPeer(t *testing.T) *peer {
	t.Helper()
	reg := httptest.NewServer(registry.New())
	t.Cleanup(reg.Close)
	return &peer{host: strings.TrimPrefix(reg.URL, "http://")}
}

// push puts a random image under repo:tag and returns it with its repo@digest reference.
func (p *peer) push(t *testing.T, repoTag string, img v1.Image) (ref, byDigest string) {
	t.Helper()
	ref = p.host + "/" + repoTag
	tag, err := name.NewTag(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, img); err != nil {
		t.Fatal(err)
	}
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return ref, tag.Context().Name() + "@" + d.String()
}

// TestFetchMissingImagesByDigest: an image the policy names by digest that this node never
// imported is pulled through the CRI by that digest and pinned, and again after the CRI deletes
// it; an unreachable one is an ImageFetchFailed Event naming it, retried with backoff and shown in
// the agent's view; no fetch starts while the image filesystem is above --fetch-max-disk-usage.
func TestFetchMissingImagesByDigest(t *testing.T) {
	n := newNode(t)
	p := newPeer(t)
	img, err := imagetest.Image(64<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	_, shared := p.push(t, "team/shared:1.0", img)
	unreachable := "127.0.0.1:1/team/gone@sha256:" + strings.Repeat("ab", 32)
	policy, err := agentimages.PolicyValues{PinnedImages: []string{shared, unreachable}}.Policy()
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	// The real measure (the CRI's image filesystem, statfs), with a limit nothing reaches.
	a := n.runWith(agentimages.PolicyValues{FetchMissingImages: true, FetchMaxDiskUsage: 100}.AgentConfig(agentimages.Config{Policy: policy, Reporter: rec}))
	took := n.await(30*time.Second, shared+" fetched and pinned", func() bool { return n.pinnedLabel(shared) })
	t.Logf("fetched by digest and pinned in %s", took)
	if present, pinned := n.criPinned(shared); !present || !pinned {
		t.Fatalf("%s: present=%t pinned=%t in the CRI", shared, present, pinned)
	}
	if src := n.labels(shared)[pinning.LabelSource]; src != pinning.SourcePolicy {
		t.Errorf("%s: source %q, want %s", shared, src, pinning.SourcePolicy)
	}
	// The pin may come first: the CRI's create event, and the policy wanting the name, re-pin it.
	n.await(5*time.Second, "an ImageFetched Event naming "+shared, func() bool { _, ok := rec.event(agentimages.ReasonImageFetched, shared); return ok })
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: shared}}); err != nil {
		t.Fatal(err)
	}
	n.await(30*time.Second, shared+" fetched again after CRI RemoveImage", func() bool { return n.pinnedLabel(shared) })
	n.await(10*time.Second, "two ImageFetched Events", func() bool { return rec.count(agentimages.ReasonImageFetched) >= 2 })

	// The unreachable one: failed, named, retried (1 s, then 2 s), in the view; never lost.
	n.await(10*time.Second, "two failed fetches of "+unreachable, func() bool { return a.View().FetchesFailed >= 2 })
	if _, ok := rec.event(agentimages.ReasonImageFetchFailed, "127.0.0.1:1/team/gone"); !ok {
		t.Errorf("no %s Event naming the unreachable image: %+v", agentimages.ReasonImageFetchFailed, rec.events)
	}
	view := a.View()
	if msg := view.FetchErrors[unreachable]; msg == "" {
		t.Errorf("the view has no fetch error for %s: %+v", unreachable, view.FetchErrors)
	}
	if !slices.Contains(view.FetchesPending, unreachable) {
		t.Errorf("the view does not show %s as pending: %v", unreachable, view.FetchesPending)
	}
	if _, ok := rec.event(agentimages.ReasonImageLost, "gone"); ok {
		t.Error("an image that can be fetched was reported lost")
	}
	if last, _ := rec.last(); !slices.Contains(last.Missing, unreachable) {
		t.Errorf("the node's protection does not list %s as missing: %+v", unreachable, last)
	}
}

// TestFetchWaitsBelowTheDiskThreshold: above --fetch-max-disk-usage no pull starts (the view
// shows the reference waiting for disk); once the image filesystem is below it, the image is
// fetched.
func TestFetchWaitsBelowTheDiskThreshold(t *testing.T) {
	n := newNode(t)
	p := newPeer(t)
	img, err := imagetest.Image(64<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	_, shared := p.push(t, "team/later:1.0", img)
	policy, err := agentimages.PolicyValues{PinnedImages: []string{shared}}.Policy()
	if err != nil {
		t.Fatal(err)
	}
	var used atomic.Int64
	used.Store(91)
	var asked atomic.Int64
	rec := &recorder{}
	cfg := agentimages.PolicyValues{FetchMissingImages: true}.AgentConfig(agentimages.Config{Policy: policy, Reporter: rec,
		ImagefsUsage: func(context.Context) (agentimages.DiskUsage, error) {
			asked.Add(1)
			return agentimages.DiskUsage{Path: "/imagefs", Used: used.Load(), Capacity: 100}, nil
		}})
	a := n.runWith(cfg)
	n.await(10*time.Second, "the fetch held back at 91%", func() bool { return slices.Contains(a.View().WaitingForDisk, shared) })
	if e, ok := rec.event(agentimages.ReasonImageFetchFailed, "above --"+agentimages.FlagFetchMaxDiskUsage+" 85%"); !ok {
		t.Errorf("no %s Event saying the threshold: %+v", agentimages.ReasonImageFetchFailed, rec.events)
	} else {
		t.Logf("event: %s", e.Message)
	}
	time.Sleep(2 * time.Second)
	if n.target(shared) != "" {
		t.Fatalf("%s was pulled while the image filesystem was above the threshold", shared)
	}
	used.Store(40)
	n.await(30*time.Second, shared+" fetched once below the threshold", func() bool { return n.pinnedLabel(shared) })
	if asked.Load() < 2 {
		t.Errorf("the usage was asked %d time(s)", asked.Load())
	}
}

// retainingFetcher is an image pushed to a peer as name (repo:tag) and in file, an OCI archive of
// the images dir, imported and pinned by a running agent that fetches and retains removed
// archives.
type retainingFetcher struct {
	n                  *node
	a                  *agentimages.Agent
	rec                *recorder
	img                v1.Image
	tag, byDigest      string
	archive, stateFile string
}

func newRetainingFetcher(t *testing.T, name, file string) *retainingFetcher {
	t.Helper()
	f := &retainingFetcher{n: newNode(t), rec: &recorder{}, stateFile: filepath.Join(t.TempDir(), "state.json")}
	var err error
	if f.img, err = imagetest.Image(64<<10, imagetest.Amd64); err != nil {
		t.Fatal(err)
	}
	f.tag, f.byDigest = newPeer(t).push(t, name, f.img)
	// An OCI archive keeps the image's digest (what the peer serves); a docker archive's is known
	// once imported, and a peer that imported the same archive serves that one.
	f.archive = filepath.Join(f.n.imagesDir, file)
	if err := imagetest.WriteOCI(f.archive, map[string]any{f.tag: f.img}); err != nil {
		t.Fatal(err)
	}
	cfg := agentimages.PolicyValues{FetchMissingImages: true, RetainRemovedArchiveImages: true, FetchMaxDiskUsage: 100}.AgentConfig(agentimages.Config{StateFile: f.stateFile, Reporter: f.rec})
	f.a = f.n.runWith(cfg)
	f.n.await(10*time.Second, f.tag+" imported and pinned", func() bool { return f.n.pinnedLabel(f.tag) && f.n.pinnedLabel(f.byDigest) })
	return f
}

// TestRetainedArchiveStaysPinnedAndIsFetched (--retain-removed-archive-images): an archive
// removed from the images dir leaves its images pinned, shown as retained; one deleted is fetched
// by its recorded digest and its tag made again, pinned; `unpin` lets it go for good.
func TestRetainedArchiveStaysPinnedAndIsFetched(t *testing.T) {
	f := newRetainingFetcher(t, "team/kept:1.0", "kept.tar")
	n, a, rec, img, tag, byDigest, archive, state := f.n, f.a, f.rec, f.img, f.tag, f.byDigest, f.archive, f.stateFile
	if err := os.Remove(archive); err != nil {
		t.Fatal(err)
	}
	n.await(10*time.Second, "kept.tar retained in the state file", func() bool {
		s, _ := statefile.Load(state)
		return s.Retained["kept.tar"] != nil && s.Archives["kept.tar"] == nil
	})
	for _, ref := range []string{tag, byDigest} {
		if present, pinned := n.criPinned(ref); !present || !pinned {
			t.Errorf("%s after its archive was removed: present=%t pinned=%t", ref, present, pinned)
		}
	}
	snap, err := a.Inspect(n.ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range snap.Refs {
		if r.Ref == tag && (!r.Retained || !r.Wanted || r.Source != "kept.tar") {
			t.Errorf("status row of %s: %+v, want retained, wanted, source kept.tar", tag, r)
		}
	}
	// Deleted: no archive to restore from, fetched by the recorded digest; the tag made again.
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: tag}}); err != nil {
		t.Fatal(err)
	}
	n.await(30*time.Second, tag+" back by a fetch, pinned", func() bool { return n.pinnedLabel(tag) && n.pinnedLabel(byDigest) })
	if got, want := n.target(tag), n.target(byDigest); got != want {
		t.Errorf("%s points at %s, %s at %s", tag, got, byDigest, want)
	}
	if d, _ := img.Digest(); n.target(tag) != d.String() {
		t.Errorf("%s points at %s, recorded %s", tag, n.target(tag), d)
	}
	if src := n.labels(tag)[pinning.LabelSource]; src != "kept.tar" {
		t.Errorf("%s: source %q after the fetch, want kept.tar", tag, src)
	}
	if _, ok := rec.event(agentimages.ReasonImageLost, tag); ok {
		t.Errorf("%s reported lost although it can be fetched", tag)
	}
	// `k3s-pinning unpin`, another process on the same state file: the tag and the digest
	// reference go, the archive is forgotten, and the running agent pins nothing again, neither
	// on the unpin's events nor at its next sync, nor writes the record back.
	cli := agentimages.NewAgent(agentimages.Services(n.client), agentimages.Config{ImagesDir: n.imagesDir, StateFile: state})
	if _, err := cli.UnpinManual(n.ctx, tag); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // the running agent sees the unpin's events
	a.Sync(n.ctx)
	for _, ref := range []string{tag, byDigest} {
		if n.pinnedLabel(ref) {
			t.Errorf("%s still pinned after unpin", ref)
		}
	}
	if s, _ := statefile.Load(state); s.Retained["kept.tar"] != nil {
		t.Errorf("kept.tar still retained after unpin: %+v", s.Retained["kept.tar"])
	}
}

// TestArchiveRemovedJustBeforeItsImageIsDeleted (--retain-removed-archive-images, issue "Trust"
// item 9): the archive deleted and, before the agent follows the images dir's change (a second
// later), its image removed through the CRI. The restore finds no archive; the tag and the digest
// reference come back by a fetch, pinned for the retained archive, and nothing is reported lost.
func TestArchiveRemovedJustBeforeItsImageIsDeleted(t *testing.T) {
	f := newRetainingFetcher(t, "team/raced:1.0", "raced.tar")
	n, rec, tag, byDigest := f.n, f.rec, f.tag, f.byDigest
	if err := os.Remove(f.archive); err != nil {
		t.Fatal(err)
	}
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: tag}}); err != nil {
		t.Fatal(err)
	}
	n.await(30*time.Second, tag+" and "+byDigest+" back, pinned", func() bool { return n.pinnedLabel(tag) && n.pinnedLabel(byDigest) })
	n.await(10*time.Second, "an ImageFetched Event naming "+tag, func() bool { _, ok := rec.event(agentimages.ReasonImageFetched, tag); return ok })
	for _, ref := range []string{tag, byDigest} {
		if src := n.labels(ref)[pinning.LabelSource]; src != "raced.tar" {
			t.Errorf("%s: pinned for %q, want the retained raced.tar", ref, src)
		}
		if e, ok := rec.event(agentimages.ReasonImageLost, ref); ok {
			t.Errorf("reported lost although it could be fetched: %s", e.Message)
		}
	}
}

// TestFetchEndsWhenNothingWantsIt (issue "Trust", item 4): a workload's image named by digest
// whose registry fails every pull is retried with backoff, and a failure failing again the same
// way does not write the state file again; once the workload is gone the fetch is dropped, its
// error forgotten, and no pull follows.
func TestFetchEndsWhenNothingWantsIt(t *testing.T) {
	n := newNode(t)
	var pulls atomic.Int64
	reg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "/manifests/") {
			pulls.Add(1)
		}
		http.Error(w, "registry down", http.StatusInternalServerError)
	}))
	t.Cleanup(reg.Close)
	ref := strings.TrimPrefix(reg.URL, "http://") + "/team/gone@sha256:" + strings.Repeat("cd", 32)
	state := filepath.Join(t.TempDir(), "state.json")
	cfg := agentimages.PolicyValues{FetchMissingImages: true, FetchMaxDiskUsage: 100, PinnedWorkloadImages: true}.AgentConfig(agentimages.Config{StateFile: state})
	a := n.runWith(cfg)
	a.SetWorkloadImages(namedByWorkloads(ref))
	n.await(30*time.Second, "a first failed fetch of "+ref, func() bool { return a.View().FetchesFailed >= 1 })
	n.await(10*time.Second, "the state file showing the failure", func() bool {
		s, err := statefile.Load(state)
		return err == nil && s.Agent.FetchErrors[ref] != ""
	})
	written, err := os.Stat(state)
	if err != nil {
		t.Fatal(err)
	}
	n.await(30*time.Second, "two more failed fetches", func() bool { return a.View().FetchesFailed >= 3 })
	if now, err := os.Stat(state); err != nil || !os.SameFile(written, now) {
		t.Errorf("the state file was written again for a fetch failing the same way (%v)", err)
	}

	a.SetWorkloadImages(namedByWorkloads())
	n.await(10*time.Second, "the fetch dropped, its error forgotten", func() bool {
		v := a.View()
		return len(v.FetchesPending) == 0 && v.FetchErrors[ref] == ""
	})
	before := pulls.Load()
	time.Sleep(7 * time.Second) // longer than the next retry (8 s of backoff at most 4 s away, jitter included)
	if after := pulls.Load(); after != before {
		t.Errorf("%d pull(s) of %s after nothing wanted it", after-before, ref)
	}
	if s, _ := statefile.Load(state); s.Agent.FetchErrors[ref] != "" {
		t.Errorf("the state file still shows the dropped fetch's error: %v", s.Agent.FetchErrors)
	}
}
