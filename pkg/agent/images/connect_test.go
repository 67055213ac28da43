package images_test

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"

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

// TestStreamEndsWhileContainerdHangs (issue "Trust", item 5): on a client from Connect, a blob's
// write to a frozen containerd ends with an error once no message moved for the call timeout,
// while the event subscription, quiet for longer than that, still delivers once containerd goes
// on.
func TestStreamEndsWhileContainerdHangs(t *testing.T) {
	n := newNode(t)
	const bound = 2 * time.Second
	client, err := agentimages.Connect(n.daemon.Address, agentimages.WithCallTimeout(bound))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	ctx, cancel := context.WithCancel(n.ctx)
	defer cancel()
	subscribed := time.Now()
	events, _ := client.Subscribe(ctx, `topic~="/images/"`)
	w, err := client.ContentStore().Writer(ctx, content.WithRef("k3s-pinning-stream-test"))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.Write([]byte("before the freeze")); err != nil {
		t.Fatal(err)
	}

	thaw := n.daemon.Freeze()
	defer thaw()
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		_, err := w.Write(bytes.Repeat([]byte("x"), 1<<20))
		done <- err
	}()
	select {
	case err := <-done:
		t.Logf("a blob's write with containerd frozen ended in %s: %v", time.Since(start).Round(time.Millisecond), err)
		if err == nil {
			t.Error("a blob's write with containerd frozen reported no error")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("a blob's write with containerd frozen did not end within 60 s")
	}
	thaw()

	// The subscription stays quiet for longer than the bound: not a wait for a condition, the
	// quiet spell itself.
	time.Sleep(time.Until(subscribed.Add(3 * bound)))
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	n.ctrImport(filepath.Join(n.imagesDir, "app.tar"))
	select {
	case e := <-events:
		t.Logf("after %s quiet, the subscription delivered %s", time.Since(subscribed).Round(time.Millisecond), e.Topic)
	case <-time.After(30 * time.Second):
		t.Fatal("the event subscription, quiet for longer than the call timeout, delivered nothing within 30 s of an import")
	}
}
