package images_test

import (
	"testing"
	"time"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// TestSyncEndsWhileContainerdHangs (issue "Trust", item 5): with containerd frozen (its socket
// accepts, nothing answers), a sync on a client from Connect ends within its call timeout, with
// an error, instead of holding the agent for ever; once containerd goes on, a sync succeeds.
func TestSyncEndsWhileContainerdHangs(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	client, err := agentimages.Connect(n.daemon.Address, agentimages.WithCallTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	a := agentimages.NewAgent(agentimages.Services(client), agentimages.Config{ImagesDir: n.imagesDir})
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	thaw := n.daemon.Freeze()
	defer thaw()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- a.Sync(n.ctx).Err() }()
	select {
	case err := <-done:
		t.Logf("sync with containerd frozen ended in %s: %v", time.Since(start).Round(time.Millisecond), err)
		if err == nil {
			t.Error("a sync with containerd frozen reported no error")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("a sync with containerd frozen did not end within 60 s")
	}
	thaw()
	if err := a.Sync(n.ctx).Err(); err != nil {
		t.Errorf("sync once containerd went on: %v", err)
	}
}
