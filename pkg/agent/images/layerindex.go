package images

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	containerdlabels "github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/sirupsen/logrus"
)

// layerIndexStore is the content store as containerd's archive import sees it during a sync. For
// every image of a docker archive that import walks the whole content store, filtered, to find a
// compressed copy of each layer: N images made a cold load O(N²) in the size of the store (at
// 1,000 images, 40% of the work in-process). This store answers that one query from the
// snapshot's single walk. Blobs imported during the sync carry no such label (import stores
// layers as the archive has them), so the answer is the walk's; a blob labelled by a pull since
// is found by the next sync, and meanwhile the layer is stored as the archive has it.
type layerIndexStore struct {
	content.Store
	im     *importer
	snap   *storeCache
	writes *archiveImport // what the import of one archive writes
}

func (s layerIndexStore) Writer(ctx context.Context, opts ...content.WriterOpt) (content.Writer, error) {
	return s.writes.writer(ctx, s.Store, opts)
}

// ReaderAt reads what the import wrote from what its writers kept (archiveImport.ReaderAt):
// containerd's import reads back each docker image's manifest and config (for its platform) and
// the start of each layer (for its compression), three reads and three lookups per image.
func (s layerIndexStore) ReaderAt(ctx context.Context, desc ocispec.Descriptor) (content.ReaderAt, error) {
	return s.writes.ReaderAt(ctx, desc)
}

// defaultWriterStalled is how long another writer of a ref may write nothing before the import
// writes the blob under a ref of its own (openWriter): a writer at work writes more often.
const defaultWriterStalled = 10 * time.Second

// openWriter opens a writer of cs with opts (whose ref is ref), and gets past a ref whose lock
// containerd lost.
// containerd's metadata store takes a ref's lock inside the transaction that records the ingest;
// when that transaction fails to commit (a full disk: "write meta.db: no space left on device")
// it returns the error and keeps the lock until it restarts. Every later writer of the ref is then
// told it is locked, and containerd's client (content.OpenWriter) waits for as long as its context
// lasts: a sync that never ends once the disk has room again (containerd 1.7 and 2.2 alike). A locked ref whose ingest containerd has no record of, or whose data has not
// grown for stalled, is written under a ref of its own; a writer at work is waited for, as the
// client does.
func openWriter(ctx context.Context, cs content.Store, ref string, opts []content.WriterOpt, stalled time.Duration) (content.Writer, error) {
	w, err := cs.Writer(ctx, opts...)
	if !errdefs.IsUnavailable(err) {
		return w, err
	}
	offset, since := int64(-1), time.Now()
	for {
		st, serr := cs.Status(ctx, ref)
		if errdefs.IsNotFound(serr) {
			break // locked, yet no ingest: the lock of a transaction that failed
		} else if serr != nil {
			return nil, err
		}
		if st.Offset != offset {
			offset, since = st.Offset, time.Now()
		} else if time.Since(since) >= stalled {
			break
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(stalled / 20):
		}
		if w, err = cs.Writer(ctx, opts...); !errdefs.IsUnavailable(err) {
			return w, err
		}
	}
	own := fmt.Sprintf("%s-%d", ref, time.Now().UnixNano())
	logrus.Warnf("containerd holds the lock of %s with no writer at work on it (%v): writing it as %s", ref, err, own)
	return cs.Writer(ctx, append(slices.Clip(opts), content.WithRef(own))...)
}

// uncompressedFilter is how containerd's import asks for the compressed copies of one layer.
const uncompressedFilter = `labels."` + containerdlabels.LabelUncompressed + `"==`

func (s layerIndexStore) Walk(ctx context.Context, fn content.WalkFunc, filters ...string) error {
	var layers []digest.Digest
	for _, f := range filters {
		d, err := digest.Parse(strings.TrimPrefix(f, uncompressedFilter))
		if !strings.HasPrefix(f, uncompressedFilter) || err != nil {
			return s.Store.Walk(ctx, fn, filters...) // not the import's query: ask containerd
		}
		layers = append(layers, d)
	}
	if len(layers) == 0 || s.snap.lookup {
		return s.Store.Walk(ctx, fn, filters...)
	}
	s.snap.mu.Lock()
	err := s.im.walkContent(ctx, s.snap)
	var found []content.Info
	for _, d := range layers {
		found = append(found, s.snap.compressed[d]...)
	}
	s.snap.mu.Unlock()
	if err != nil {
		return err
	}
	for _, info := range found {
		if err := fn(info); err != nil {
			return err
		}
	}
	return nil
}
