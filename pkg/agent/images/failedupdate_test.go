package images_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// updateFailing is containerd's image store with the updates of one name failing while fail is
// set, as a containerd restarting under the agent fails them (the soak saw EOF).
type updateFailing struct {
	images.Store
	name string
	fail atomic.Bool
}

func (s *updateFailing) Update(ctx context.Context, img images.Image, fieldpaths ...string) (images.Image, error) {
	if s.fail.Load() && img.Name == s.name {
		return images.Image{}, errors.New("rpc error: code = Unavailable desc = error reading from server: EOF")
	}
	return s.Store.Update(ctx, img, fieldpaths...)
}

// TestFailedTagUpdateLeavesNoStaleDigest: a docker archive replaced by another image under the
// same tag, whose tag update fails once, provides the old image's digest reference only until an
// import moves the tag: then the old digest reference is no longer wanted and its pin goes (the
// soak found it kept for ever).
func TestFailedTagUpdateLeavesNoStaleDigest(t *testing.T) {
	n := newNode(t)
	const tag = "acc.example/app:1.0"
	archive := filepath.Join(n.imagesDir, "app.tar")
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{tag}})
	store := &updateFailing{Store: n.client.ImageService(), name: tag}
	cd := agentimages.Services(n.client)
	cd.Images = store
	a := agentimages.NewAgent(cd, agentimages.Config{ImagesDir: n.imagesDir, StateFile: filepath.Join(t.TempDir(), "state.json")})
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	old := n.target(tag)
	oldRef := "acc.example/app@" + old
	if !n.pinnedLabel(oldRef) {
		t.Fatalf("%s not pinned after the first load", oldRef)
	}

	// The archive is replaced (another image, the same tag); the tag's update fails.
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{tag}})
	later := time.Now().Add(time.Minute)
	if err := os.Chtimes(archive, later, later); err != nil {
		t.Fatal(err)
	}
	store.fail.Store(true)
	if err := a.Sync(n.ctx).Err(); err == nil || !strings.Contains(err.Error(), "EOF") {
		t.Fatalf("the sync with the tag's update failing reported %v", err)
	}
	if n.target(tag) != old {
		t.Fatalf("the tag moved although its update failed")
	}

	// containerd answers again: the unchanged archive's import moves the tag, and the old digest
	// reference is wanted by nothing.
	store.fail.Store(false)
	for i := 0; i < 3; i++ {
		if err := a.Sync(n.ctx).Err(); err != nil {
			t.Fatalf("sync %d after the failure: %v", i+1, err)
		}
	}
	if n.target(tag) == old {
		t.Fatalf("the tag still points at the old image after the failure passed")
	}
	if n.pinnedLabel(oldRef) {
		t.Errorf("%s, the replaced image's digest reference, still pinned: the archive provides it no more", oldRef)
	}
	if a.Keeper().Keep("sha256:none", nil, []string{oldRef}) {
		t.Errorf("the kubelet's filter still keeps %s", oldRef)
	}
	if newRef := "acc.example/app@" + n.target(tag); !n.pinnedLabel(newRef) {
		t.Errorf("%s, the archive's image now, not pinned", newRef)
	}
}
