package images_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	containerdlabels "github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/typeurl/v2"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/k3spinning"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// stockK3sImport imports path as stock k3s does (client.Import, all platforms) and sets k3s's
// two pin labels on what it created.
func (n *node) stockK3sImport(path string) {
	n.t.Helper()
	f, err := os.Open(path)
	if err != nil {
		n.t.Fatal(err)
	}
	defer f.Close()
	imgs, err := n.client.Import(n.ctx, f, containerd.WithAllPlatforms(true))
	if err != nil {
		n.t.Fatal(err)
	}
	for _, img := range imgs {
		img.Labels = map[string]string{pinning.LabelPinned: pinning.PinnedValue, pinning.LabelK3sPinned: pinning.PinnedValue}
		if _, err := n.client.ImageService().Update(n.ctx, img, "labels."+pinning.LabelPinned, "labels."+pinning.LabelK3sPinned); err != nil {
			n.t.Fatal(err)
		}
	}
}

// TestStartTakesOverTheImagesDir is the entry point the k3s patch calls from PreloadImages, on
// a node where stock k3s ran before: everything k3s's import does is done (name@digest, the
// --airgap-extra-registry tag and digest, distribution-source labels on the content, .txt lists
// satisfied through the CRI, .cache.json left alone), each reference pinned from its creation;
// k3s's own pins are adopted with no moment unpinned; then the agent keeps running.
func TestStartTakesOverTheImagesDir(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/team/app:1.0"}})
	writeArchive(t, n.imagesDir, archiveCase{file: "oci.tar.zst", oci: true, refs: []string{"acc.example/oci:1.0"}})
	if err := os.WriteFile(filepath.Join(n.imagesDir, "pull.txt"), []byte("acc.example/team/app:1.0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(n.imagesDir, ".cache.json")
	if err := os.WriteFile(cache, []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	// What stock k3s left: an archive it imported and pinned, still in the images dir, and a
	// pinned image whose archive is gone.
	img, err := imagetest.Image(64<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	if err := imagetest.WriteDocker(filepath.Join(n.imagesDir, "old.tar"), map[string]v1.Image{"acc.example/old:1.0": img}); err != nil {
		t.Fatal(err)
	}
	n.stockK3sImport(filepath.Join(n.imagesDir, "old.tar"))
	gone := filepath.Join(t.TempDir(), "gone.tar")
	writeArchive(t, filepath.Dir(gone), archiveCase{file: "gone.tar", refs: []string{"acc.example/gone:1.0"}})
	n.stockK3sImport(gone)

	// Every label change of acc.example/old:1.0 is watched: k3s's pin must never be missing.
	var mu sync.Mutex
	var unpinnedOld []string
	evCtx, stopEvents := context.WithCancel(n.ctx)
	defer stopEvents()
	// containerd's client never closes evs: a failed subscription shows only on errs, and would
	// otherwise leave the check below seeing nothing.
	evs, errs := n.client.Subscribe(evCtx, `topic=="/images/update"`)
	var subscriptionErr error
	seenOld := 0 // updates of acc.example/old:1.0 seen: the adoption below makes at least one
	go func() {
		for {
			select {
			case err := <-errs:
				if err != nil && evCtx.Err() == nil {
					mu.Lock()
					subscriptionErr = err
					mu.Unlock()
				}
				return
			case env := <-evs:
				ev, err := typeurl.UnmarshalAny(env.Event)
				if err != nil {
					continue
				}
				if u, ok := ev.(*eventstypes.ImageUpdate); ok && u.Name == "acc.example/old:1.0" {
					mu.Lock()
					seenOld++
					if !pinning.IsPinned(u.Labels) {
						unpinnedOld = append(unpinnedOld, u.String())
					}
					mu.Unlock()
				}
			}
		}
	}()

	ctx, cancel := context.WithCancel(n.ctx)
	rec := &stallRecorder{recorder: &recorder{}}
	workloads := make(chan func(agentimages.WorkloadImages), 1) // the agent's update, handed to the watcher
	keeper, done, err := k3spinning.Start(ctx, k3spinning.Config{Address: n.daemon.Address, ImagesDir: n.imagesDir,
		ExtraRegistries: []string{"mirror.local:5000"}, Reporter: rec,
		Settings: k3spinning.Settings{PolicyValues: agentimages.PolicyValues{PinnedWorkloadImages: true, WorkloadNamespaces: []string{"tenant"}, FetchMaxDiskUsage: anyDiskUsage}},
		WatchWorkloads: func(ctx context.Context, scope agentimages.WorkloadScope, update func(agentimages.WorkloadImages)) {
			if !slices.Equal(scope.Namespaces, []string{"tenant"}) {
				t.Errorf("the workload watcher was given the namespaces %q, want [tenant]", scope.Namespaces)
			}
			workloads <- update
			<-ctx.Done()
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("the agent stopped with %v", err)
		}
	})
	// The node condition can say the agent is stuck: k3spinning.Start tells the Reporter how.
	if rec.stallAfter != agentimages.StalledIntervals*agentimages.DefaultReconcileInterval || rec.reconciled == nil || rec.reconciled().IsZero() {
		t.Errorf("the Reporter was not told how to see the agent stalled (bound %s; a reconcile seen: %v)", rec.stallAfter, rec.reconciled != nil && !rec.reconciled().IsZero())
	}

	// Everything k3s's import creates, pinned, and recorded for its archive.
	digest := n.target("acc.example/team/app:1.0")
	for _, ref := range []string{"acc.example/team/app:1.0", "acc.example/team/app@" + digest,
		"mirror.local:5000/team/app:1.0", "mirror.local:5000/team/app@" + digest, "acc.example/oci:1.0"} {
		if present, pinned := n.criPinned(ref); !present || !pinned {
			t.Errorf("%s: present=%t pinned=%t", ref, present, pinned)
		}
	}
	if src := n.labels("acc.example/team/app:1.0")[pinning.LabelSource]; src != "app.tar" {
		t.Errorf("app:1.0 source %q, want app.tar", src)
	}
	// The embedded registry (spegel) serves only content labelled with its registry.
	appImg, err := n.client.ImageService().Get(n.ctx, "acc.example/team/app:1.0")
	if err != nil {
		t.Fatal(err)
	}
	labelled := 0
	images.Walk(n.ctx, images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
		info, err := n.client.ContentStore().Info(ctx, desc.Digest)
		if err != nil {
			t.Errorf("content %s: %v", desc.Digest, err)
			return nil, nil
		}
		for _, reg := range []string{"acc.example", "mirror.local:5000"} {
			if got := info.Labels[containerdlabels.LabelDistributionSource+"."+reg]; got != "team/app" {
				t.Errorf("content %s (%s): distribution source for %s = %q, want team/app", desc.Digest, desc.MediaType, reg, got)
			}
		}
		if info.Labels["containerd.io/gc.ref.content.l.0"] == "" && strings.Contains(desc.MediaType, "manifest") {
			t.Errorf("manifest %s lost its GC labels", desc.Digest)
		}
		labelled++
		return images.Children(ctx, n.client.ContentStore(), desc)
	}), appImg.Target)
	if labelled < 3 {
		t.Errorf("%d blobs walked, want manifest, config and layer", labelled)
	}

	// k3s's pins: adopted where the images dir still provides the image, never unpinned; cleared
	// where it does not, as k3s does at start.
	old := n.labels("acc.example/old:1.0")
	if !pinning.IsPinned(old) || old[pinning.LabelSource] != "old.tar" || old[pinning.LabelK3sPinned] != "" {
		t.Errorf("acc.example/old:1.0 labels %v, want our pin for old.tar and k3s's mark gone", old)
	}
	// The adoption's label update is the last write to it; its event may still be on its way.
	n.await(5*time.Second, "the adoption's update of acc.example/old:1.0 seen in containerd's events", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return seenOld > 0 || subscriptionErr != nil
	})
	mu.Lock()
	if subscriptionErr != nil {
		t.Errorf("containerd's event subscription failed, so no unpin could be seen: %v", subscriptionErr)
	}
	if len(unpinnedOld) > 0 {
		t.Errorf("acc.example/old:1.0 was unpinned on the way: %v", unpinnedOld)
	}
	mu.Unlock()
	if l := n.labels("acc.example/gone:1.0"); pinning.IsPinned(l) || l[pinning.LabelK3sPinned] != "" {
		t.Errorf("acc.example/gone:1.0 labels %v, want k3s's stale pin cleared (the image stays)", l)
	}
	// The adoption as one event naming the pin taken over; the node protected.
	if e, ok := rec.event(agentimages.ReasonPinsAdopted, "acc.example/old:1.0"); !ok || e.Warning {
		t.Errorf("no Normal PinsAdopted event naming acc.example/old:1.0: %+v", rec.events)
	}
	if p, _ := rec.last(); !p.Protected() {
		t.Errorf("after start-up: %s", p.Summary())
	}
	// The list was satisfied by the tarball (no pull: acc.example does not resolve here), nothing
	// failed, and k3s's .cache.json is neither read as an archive nor written.
	state, err := statefile.Load(filepath.Join(filepath.Dir(n.imagesDir), "k3s-pinning", "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(state.Agent.ArchiveErrors) != 0 {
		t.Errorf("archive errors at start-up: %v", state.Agent.ArchiveErrors)
	}
	if data, _ := os.ReadFile(cache); string(data) != "{}" {
		t.Errorf(".cache.json changed: %q", data)
	}

	// The kubelet GC filter's decision, and the agent running behind it.
	if !keeper.Keep("", []string{"acc.example/team/app:1.0"}, nil) || keeper.Keep("", []string{"acc.example/gone:1.0"}, nil) {
		t.Error("keeper: want app:1.0 kept and gone:1.0 not")
	}
	n.setLabel("acc.example/oci:1.0", pinning.LabelPinned, "")
	n.await(2*time.Second, "oci:1.0 re-pinned by the running agent", func() bool { return n.pinnedLabel("acc.example/oci:1.0") })
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: "acc.example/team/app:1.0"}}); err != nil {
		t.Fatal(err)
	}
	n.await(10*time.Second, "app:1.0 restored from app.tar", func() bool { return n.pinnedLabel("acc.example/team/app:1.0") })

	// --pinned-workload-images: the watcher given is started with the agent's update; the image
	// k3s left whose archive is gone is a workload's, so it is pinned again, for the workload.
	select {
	case update := <-workloads:
		update(namedByWorkloads("acc.example/gone:1.0"))
	case <-time.After(5 * time.Second):
		t.Fatal("k3spinning.Start did not start the workload watcher")
	}
	n.await(10*time.Second, "gone:1.0 pinned for its workload", func() bool { return n.pinnedLabel("acc.example/gone:1.0") })
	if src := n.labels("acc.example/gone:1.0")[pinning.LabelSource]; src != pinning.SourceWorkload {
		t.Errorf("gone:1.0 pinned with source %q, want workload", src)
	}
}

// TestStartOptions: --disable-image-restore keeps pins but does not re-import; with
// --disable-image-pinning the entry point refuses (the patch runs k3s's own import instead); a
// malformed policy is an error naming the flag.
func TestStartOptions(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	cfg := k3spinning.Config{Address: n.daemon.Address, ImagesDir: n.imagesDir, StateFile: filepath.Join(t.TempDir(), "state.json")}

	disabled := cfg
	disabled.DisableImagePinning = true
	if _, _, err := k3spinning.Start(n.ctx, disabled); err == nil || !strings.Contains(err.Error(), "--disable-image-pinning") {
		t.Errorf("disabled: err %v, want one naming --disable-image-pinning", err)
	}
	bad := cfg
	bad.PinnedImages = []string{"registry.local/[x"}
	if _, _, err := k3spinning.Start(n.ctx, bad); err == nil || !strings.Contains(err.Error(), "--pinned-images") {
		t.Errorf("malformed policy: err %v, want one naming --pinned-images", err)
	}

	ctx, cancel := context.WithCancel(n.ctx)
	noRestore := cfg
	noRestore.DisableImageRestore = true
	_, done, err := k3spinning.Start(ctx, noRestore)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("the agent stopped with %v", err)
		}
	})
	if present, pinned := n.criPinned("acc.example/app:1.0"); !present || !pinned {
		t.Fatalf("app:1.0 present=%t pinned=%t", present, pinned)
	}
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: "acc.example/app:1.0"}}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	if n.target("acc.example/app:1.0") != "" {
		t.Error("app:1.0 restored although --disable-image-restore is set")
	}
}

// stallRecorder is a recorder that is also a ReconcileWatcher, as pkg/agent/cluster's Node is.
type stallRecorder struct {
	*recorder
	reconciled func() time.Time
	stallAfter time.Duration
}

func (r *stallRecorder) WatchReconciles(reconciled func() time.Time, stallAfter time.Duration) {
	r.reconciled, r.stallAfter = reconciled, stallAfter
}
