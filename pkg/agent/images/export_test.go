package images

import (
	"context"
	"io"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// SetWriterStalled sets how long a's imports wait on another writer that writes nothing.
func SetWriterStalled(a *Agent, d time.Duration) { a.importer.writerStalled = d }

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
