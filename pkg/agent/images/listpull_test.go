package images_test

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// silentRegistry is a TCP listener on loopback that accepts every connection and never answers:
// a registry that hangs.
func silentRegistry(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// TestHangingListPullStallsNothing (issue "Trust", item 5): a .txt list names an image of a
// registry that accepts and never answers, and one of a registry that does. The agent's syncs
// finish (the pulls wait in the background; the answered one is pinned once pulled), an air-gap image removed through the CRI is restored within seconds, and the
// node's protection says the list's image is missing.
func TestHangingListPullStallsNothing(t *testing.T) {
	n := newNode(t)
	app := "acc.example/app:1.0"
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{app}})
	hung := silentRegistry(t) + "/team/hang:1.0"
	img, err := imagetest.Image(32<<10, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	good, _ := newPeer(t).push(t, "team/good:1.0", img)
	if err := os.WriteFile(filepath.Join(n.imagesDir, "pull.txt"), []byte(hung+"\n"+good+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	a := n.runWith(agentimages.Config{StateFile: filepath.Join(t.TempDir(), "state.json"), Reporter: rec})
	n.await(20*time.Second, "the first sync finished", func() bool { return !a.View().LastReconcile.IsZero() })
	if !n.pinnedLabel(app) {
		t.Fatalf("%s not pinned by the first sync", app)
	}
	n.await(20*time.Second, good+", the list's other entry, pulled in the background and pinned", func() bool { return n.pinnedLabel(good) })
	if src := n.labels(good)[pinning.LabelSource]; src != "pull.txt" {
		t.Errorf("%s pinned for %q, want pull.txt", good, src)
	}
	if _, err := n.cri.RemoveImage(n.ctx, &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: app}}); err != nil {
		t.Fatal(err)
	}
	took := n.await(10*time.Second, app+" restored while the list's pull hangs", func() bool { return n.pinnedLabel(app) })
	t.Logf("restored in %s", took)
	n.await(10*time.Second, "the protection reporting "+hung+" missing", func() bool {
		last, _ := rec.last()
		return slices.Contains(last.Missing, hung)
	})
	// A sync asked for now also ends: nothing holds the agent's lock for the pull.
	done := make(chan struct{})
	go func() { a.Sync(n.ctx); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("a sync did not end within 20 s while the list's pull hangs")
	}
}
