package images_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

// heldPeer is a registry on loopback whose blobs (config and layers) are served only once
// release is closed: what a pull downloads before them is its manifests. Images are pushed to
// it through pushTo, which holds nothing; the same registry serves both.
type heldPeer struct {
	peer
	pushTo  peer
	release chan struct{}
	held    atomic.Int64 // blob requests that waited
}

func newHeldPeer(t *testing.T) *heldPeer {
	t.Helper()
	h := &heldPeer{release: make(chan struct{})}
	reg := registry.New()
	push := httptest.NewServer(reg)
	held := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/") {
			h.held.Add(1)
			select {
			case <-h.release:
			case <-r.Context().Done():
				return
			}
		}
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		held.CloseClientConnections()
		held.Close()
		push.Close()
	})
	h.host, h.pushTo.host = strings.TrimPrefix(held.URL, "http://"), strings.TrimPrefix(push.URL, "http://")
	return h
}

// pushRandom pushes a random image of size bytes under repoTag and returns its repo@digest
// reference as pulled from the held side.
func (h *heldPeer) pushRandom(t *testing.T, repoTag string, size int64) string {
	t.Helper()
	img, err := imagetest.Image(size, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	_, pushed := h.pushTo.push(t, repoTag, img)
	return h.host + strings.TrimPrefix(pushed, h.pushTo.host)
}

// TestFetchStopsWhenTheImageWouldFillTheDisk (issue "Trust", item 2): a fetch that starts below
// --fetch-max-disk-usage is stopped as soon as its manifest tells the image's size, when that
// size would bring the image filesystem above the threshold: before any of its blobs was
// served. The image is fetched once there is room.
func TestFetchStopsWhenTheImageWouldFillTheDisk(t *testing.T) {
	n := newNode(t)
	p := newHeldPeer(t)
	big := p.pushRandom(t, "team/big:1.0", 8<<20)
	policy, err := agentimages.PolicyValues{PinnedImages: []string{big}}.Policy()
	if err != nil {
		t.Fatal(err)
	}
	var used atomic.Int64
	used.Store(80 << 20)
	rec := &recorder{}
	a := n.runWith(agentimages.PolicyValues{FetchMissingImages: true}.AgentConfig(agentimages.Config{Policy: policy, Reporter: rec,
		ImagefsUsage: func(context.Context) (agentimages.DiskUsage, error) {
			return agentimages.DiskUsage{Path: "/imagefs", Used: used.Load(), Capacity: 100 << 20}, nil
		}}))
	var refusal agentimages.Event
	n.await(30*time.Second, "the fetch of "+big+" stopped for its size", func() bool {
		var ok bool
		refusal, ok = rec.event(agentimages.ReasonImageFetchFailed, "from 80% to 8")
		return ok
	})
	t.Logf("event: %s", refusal.Message)
	if !strings.Contains(refusal.Message, "above --"+agentimages.FlagFetchMaxDiskUsage+" 85%") || !strings.Contains(refusal.Message, "8.0") {
		t.Errorf("the refusal does not say the image's size and the threshold: %s", refusal.Message)
	}
	if p.held.Load() == 0 {
		t.Errorf("no blob was asked for: the pull was refused before it started, not on its manifest")
	}
	if n.target(big) != "" {
		t.Errorf("%s was pulled although it would fill the image filesystem", big)
	}
	if !slices.Contains(a.View().WaitingForDisk, big) {
		t.Errorf("the view does not show %s waiting for disk: %+v", big, a.View())
	}

	used.Store(10 << 20)
	close(p.release)
	n.await(90*time.Second, big+" fetched and pinned once there is room", func() bool { return n.pinnedLabel(big) })
}
