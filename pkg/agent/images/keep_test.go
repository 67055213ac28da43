package images_test

import (
	"path/filepath"
	"slices"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/keep"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// criImages lists images as the kubelet's image GC sees them.
func (n *node) criImages() []*runtimeapi.Image {
	n.t.Helper()
	resp, err := n.cri.ListImages(n.ctx, &runtimeapi.ListImagesRequest{})
	if err != nil {
		n.t.Fatalf("CRI ListImages: %v", err)
	}
	return resp.Images
}

// keptTags asks keeper about every image the CRI lists and returns the tags of those it keeps,
// and of those it does not.
func keptTags(n *node, keeper *keep.Keeper) (kept, dropped []string) {
	for _, img := range n.criImages() {
		if keeper.Keep(img.Id, img.RepoTags, img.RepoDigests) {
			kept = append(kept, img.RepoTags...)
		} else {
			dropped = append(dropped, img.RepoTags...)
		}
	}
	slices.Sort(kept)
	slices.Sort(dropped)
	return kept, dropped
}

// The keep-decision the kubelet's GC filter asks is the agent's: what the images dir provides, what
// the policy names (by pattern or by label), nothing else; asked with the CRI's own listing.
func TestKeeperKeepsWhatTheAgentWants(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "airgap.tar", refs: []string{"acc.example/airgap:1.0"}})
	writeArchive(t, n.imagesDir, archiveCase{file: "airgap-oci.tar.zst", oci: true, refs: []string{"acc.example/airgap-oci:1.0", "acc.example/airgap-multi:1.0"}})
	hand := t.TempDir()
	writeArchive(t, hand, archiveCase{file: "hand.tar", refs: []string{"registry.local/team/tool:1.0", "other.example/labelled:1.0", "other.example/unwanted:1.0"}})
	n.ctrImport(filepath.Join(hand, "hand.tar"))
	n.setLabel("other.example/labelled:1.0", "example.com/keep", "yes")

	policy, err := pinning.NewPolicy([]string{"registry.local/team/*"}, []string{"example.com/keep=yes"})
	if err != nil {
		t.Fatal(err)
	}
	agent := n.agent(policy)
	keeper := agent.Keeper()
	// Before any reconcile, the patterns answer already; labels wait for the reconcile. The CRI
	// lists the hand imports a moment after ctr made them.
	var kept, dropped []string
	n.await(5*time.Second, "the CRI listing the three hand imports", func() bool {
		kept, dropped = keptTags(n, keeper)
		return len(kept)+len(dropped) == 3
	})
	if !slices.Equal(kept, []string{"registry.local/team/tool:1.0"}) {
		t.Errorf("before the first sync, kept %v, want only the --pinned-images match", kept)
	}

	if err := agent.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// The CRI lists what the sync imported once containerd's events reached it.
	n.await(5*time.Second, "the CRI listing the three imported and three hand-imported images", func() bool {
		kept, dropped = keptTags(n, keeper)
		return len(kept)+len(dropped) == 6
	})
	wantKept := []string{"acc.example/airgap-multi:1.0", "acc.example/airgap-oci:1.0", "acc.example/airgap:1.0", "other.example/labelled:1.0", "registry.local/team/tool:1.0"}
	if !slices.Equal(kept, wantKept) || !slices.Equal(dropped, []string{"other.example/unwanted:1.0"}) {
		t.Errorf("kept %v, dropped %v; want kept %v, dropped only the unwanted hand import", kept, dropped, wantKept)
	}

	// Every name of an air-gap image gone (ctr images rm of its tag and digest reference): the CRI
	// still lists the image by its ID, and a restore needs only the names back, so the content is
	// kept.
	for _, ref := range []string{"acc.example/airgap:1.0", "acc.example/airgap@" + n.target("acc.example/airgap:1.0")} {
		if err := n.client.ImageService().Delete(n.ctx, ref); err != nil {
			t.Fatalf("delete %s: %v", ref, err)
		}
	}
	var untagged []*runtimeapi.Image
	n.await(2*time.Second, "the CRI lists the image by its ID alone", func() bool {
		untagged = slices.DeleteFunc(n.criImages(), func(img *runtimeapi.Image) bool { return len(img.RepoTags)+len(img.RepoDigests) > 0 })
		return len(untagged) == 1
	})
	if !keeper.Keep(untagged[0].Id, nil, nil) {
		t.Errorf("air-gap image %s, listed by its ID alone, is not kept", untagged[0].Id)
	}
}

// A damaged archive, or a restarted agent that has not reconciled yet, never makes the filter
// drop what the archive provided.
func TestKeeperNeverDropsWhatAnArchiveProvided(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "airgap.tar", refs: []string{"acc.example/airgap:1.0"}})
	stateFile := filepath.Join(t.TempDir(), "state.json")
	agent := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, StateFile: stateFile})
	if err := agent.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}

	restarted := images.NewAgent(images.Services(n.client), images.Config{ImagesDir: n.imagesDir, StateFile: stateFile})
	if kept, _ := keptTags(n, restarted.Keeper()); !slices.Equal(kept, []string{"acc.example/airgap:1.0"}) {
		t.Errorf("restarted agent before its first sync keeps %v, want the recorded air-gap image", kept)
	}

	truncate(t, filepath.Join(n.imagesDir, "airgap.tar"), 0.5)
	if err := restarted.Sync(n.ctx).Err(); err == nil {
		t.Fatal("sync of a truncated archive reported no error")
	}
	if kept, _ := keptTags(n, restarted.Keeper()); !slices.Equal(kept, []string{"acc.example/airgap:1.0"}) {
		t.Errorf("after the archive was damaged, kept %v, want what it provided when it loaded", kept)
	}
}
