package images_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// TestListIsPulledThroughCRIAndPinned: a .txt list is pulled through the CRI image service (so
// registry mirrors and credentials apply, as in k3s), and each reference is pinned with its
// repo@digest reference; a bad line and an unreachable registry are named and do not stop the rest.
func TestListIsPulledThroughCRIAndPinned(t *testing.T) {
	n := newNode(t)
	img, err := imagetest.Image(32<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	ref, byDigest := newPeer(t).push(t, "team/pulled:1.0", img)
	// Port 1 on loopback: nothing listens, the pull fails at once.
	list := fmt.Sprintf("# air-gap list\n%s\n\nnot/a/REF::\n127.0.0.1:1/missing/image:1.0\n", ref)
	if err := os.WriteFile(filepath.Join(n.imagesDir, "images.txt"), []byte(list), 0o644); err != nil {
		t.Fatal(err)
	}
	report := n.agent(nil).Sync(n.ctx)
	err = report.Err()
	if err == nil {
		t.Fatal("sync reported success with a bad line and an unreachable registry")
	}
	for _, want := range []string{"images.txt:4", "images.txt:5", "127.0.0.1:1/missing/image:1.0"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not name %s:\n%v", want, err)
		}
	}
	for _, r := range []string{ref, byDigest} {
		if present, pinned := n.criPinned(r); !present || !pinned {
			t.Errorf("%s: present=%t pinned=%t", r, present, pinned)
		}
		if src := n.labels(r)[pinning.LabelSource]; src != "images.txt" {
			t.Errorf("%s: source %q, want images.txt", r, src)
		}
	}
}

// TestRunRestoresListEntryByPulling: a wanted .txt reference deleted through the CRI is pulled again.
func TestRunRestoresListEntryByPulling(t *testing.T) {
	n := newNode(t)
	img, err := imagetest.Image(32<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := newPeer(t).push(t, "team/listed:1.0", img)
	if err := os.WriteFile(filepath.Join(n.imagesDir, "pull.txt"), []byte(ref+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	n.runAgent("", ref)
	want := n.target(ref)
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}}); err != nil {
		t.Fatal(err)
	}
	n.await(5*time.Second, ref+" pulled again after CRI RemoveImage", func() bool { return n.pinnedLabel(ref) })
	if got := n.target(ref); got != want {
		t.Errorf("pulled digest %s, recorded %s", got, want)
	}
}
