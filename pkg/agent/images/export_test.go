package images

import (
	"context"
	"io"
	"slices"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// SetWriterStalled sets how long the import waits on another writer that writes nothing, until
// the test ends.
func SetWriterStalled(t interface{ Cleanup(func()) }, d time.Duration) {
	old := writerStalled
	writerStalled = d
	t.Cleanup(func() { writerStalled = old })
}

// ListRecords is the store's list as a sync keeps it (listRecords), each record as containerd's
// client gives one.
func ListRecords(ctx context.Context, store images.Store) ([]images.Image, error) {
	rs, err := listRecords(ctx, store)
	if err != nil {
		return nil, err
	}
	return slices.Collect(rs.images()), nil
}

// HeadReaderAt is the reader the import answers a blob it committed with: data, the blob's first
// bytes, and past them the reader open gives.
func HeadReaderAt(data []byte, size int64, open func() (content.ReaderAt, error)) content.ReaderAt {
	return &headReaderAt{head: blobHead{data: data, size: size}, open: open}
}

// ImportLayout imports the OCI image layout read from r into store as a sync does, and returns
// its index.json's descriptor.
func ImportLayout(ctx context.Context, store content.Ingester, r io.Reader) (ocispec.Descriptor, error) {
	return importLayout(ctx, store, r)
}
