package images_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
)

// lockedBlob is a blob of the archive at path (not a manifest) whose ref, as containerd's import
// names its write, a writer of the test holds: the blob's name in the archive and its bytes.
func lockedBlob(t *testing.T, path string) (name string, data []byte) {
	t.Helper()
	a, err := airgap.At(path)
	if err != nil {
		t.Fatal(err)
	}
	idx, _, err := airgap.ReadFile(a)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for f := range idx.Content.Refs {
		if idx.Content.MediaTypes[f] == "" {
			names = append(names, f)
		}
	}
	if len(names) == 0 {
		t.Fatalf("%s: no blob but manifests in its index", path)
	}
	slices.Sort(names)
	name = names[0]
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for tr := tar.NewReader(f); ; {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("%s: %s: %v", path, name, err)
		}
		if h.Name == name {
			data, err = io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			return name, data
		}
	}
}

// lockedBlobNode is a node whose images dir holds app.tar (acc.example/app:1.0), with the lock of
// one of its blobs (lockedBlob) held by holder, a writer of the test, closed when the test ends.
func lockedBlobNode(t *testing.T) (n *node, name string, data []byte, holder content.Writer) {
	t.Helper()
	n = newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "app.tar", refs: []string{"acc.example/app:1.0"}})
	name, data = lockedBlob(t, filepath.Join(n.imagesDir, "app.tar"))
	holder, err := n.client.ContentStore().Writer(n.ctx, content.WithRef("tar-"+name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { holder.Close() })
	return n, name, data, holder
}

// TestImportGetsPastALostLock: containerd's metadata store takes a ref's lock inside the
// transaction that records its ingest, and keeps the lock when that transaction fails (CI, on
// containerd 1.7.35: the disk full while meta.db grew). containerd's client then waits on the
// ref for as long as its context lasts; the sync after the disk had room again never ended. The
// test holds the lock of a blob's ref with a writer of its own: with no ingest recorded (its
// record aborted, as the failed transaction leaves it), or with one that writes nothing. The
// sync imports the archive all the same, within a minute.
func TestImportGetsPastALostLock(t *testing.T) {
	for _, lost := range []string{"no-ingest", "stalled"} {
		t.Run(lost, func(t *testing.T) {
			n, name, data, holder := lockedBlobNode(t)
			ref, cs := "tar-"+name, n.client.ContentStore()
			if _, err := holder.Write(data[:len(data)/2]); err != nil {
				t.Fatal(err)
			}
			if lost == "no-ingest" {
				if err := cs.Abort(n.ctx, ref); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := cs.Writer(n.ctx, content.WithRef(ref)); !errdefs.IsUnavailable(err) {
				t.Fatalf("a second writer of %s: %v, want it locked", ref, err)
			}
			ctx, cancel := context.WithTimeout(n.ctx, time.Minute)
			defer cancel()
			a := n.agent(nil)
			images.SetWriterStalled(a, time.Second)
			if err := a.Sync(ctx).Err(); err != nil {
				t.Fatalf("sync with the lock of %s held: %v", ref, err)
			}
			if present, pinned := n.criPinned("acc.example/app:1.0"); !present || !pinned {
				t.Errorf("app:1.0 after the sync: present=%t pinned=%t", present, pinned)
			}
			if _, err := cs.Info(n.ctx, digest.FromBytes(data)); err != nil {
				t.Errorf("the locked blob %s after the sync: %v", name, err)
			}
		})
	}
}

// TestImportWaitsForAWriterAtWork: a ref locked by a writer that is writing is waited for, as
// containerd's client waits, not written a second time beside it: the writer commits the blob,
// and the import finds it there.
func TestImportWaitsForAWriterAtWork(t *testing.T) {
	n, name, data, holder := lockedBlobNode(t)
	ref := "tar-" + name
	committed := make(chan error, 1)
	go func() { // a slow writer: 10 chunks, one every 400 ms (the import's patience is 1 s)
		r := bytes.NewReader(data)
		chunk := len(data)/10 + 1
		for r.Len() > 0 {
			time.Sleep(400 * time.Millisecond)
			if _, err := io.CopyN(holder, r, int64(chunk)); err != nil && !errors.Is(err, io.EOF) {
				committed <- err
				return
			}
		}
		committed <- holder.Commit(n.ctx, int64(len(data)), digest.FromBytes(data))
	}()
	ctx, cancel := context.WithTimeout(n.ctx, time.Minute)
	defer cancel()
	a := n.agent(nil)
	images.SetWriterStalled(a, time.Second)
	if err := a.Sync(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := <-committed; err != nil {
		t.Errorf("the writer at work on %s: %v (the import wrote the blob beside it)", ref, err)
	}
	if present, pinned := n.criPinned("acc.example/app:1.0"); !present || !pinned {
		t.Errorf("app:1.0 after the sync: present=%t pinned=%t", present, pinned)
	}
}
