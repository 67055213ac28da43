package images

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
	"sync"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
)

// importTarball imports the content of idx's archive and returns its named top-level images, as
// client.Import does with all platforms and missing content skipped (k3s's options), but creates
// no image record: putRef does, with the pin labels. Each blob the archive's index says which
// images it is content of is committed with its labels; writes is what the import wrote
// (archiveImport). ctx must carry a lease.
func (im *importer) importTarball(ctx context.Context, snap *storeCache, idx *airgap.Index) (named []images.Image, writes *archiveImport, err error) {
	rc, err := airgap.FileOpener(idx.Archive)()
	if err != nil {
		return nil, nil, err
	}
	defer rc.Close()

	cs := im.cd.Content
	writes = &archiveImport{im: im, idx: idx, committed: map[digest.Digest]map[string]string{}, seen: map[digest.Digest][]byte{}, heads: map[digest.Digest]blobHead{}}
	store := layerIndexStore{Store: cs, im: im, snap: snap, writes: writes}
	var desc ocispec.Descriptor
	if idx.Format == airgap.OCIArchive {
		desc, err = importLayout(ctx, store, rc)
	} else {
		desc, err = archive.ImportIndex(ctx, store, rc)
	}
	if err != nil {
		return nil, nil, err
	}
	data, err := content.ReadBlob(ctx, writes, desc)
	if err != nil {
		return nil, nil, err
	}
	var index ocispec.Index
	if err := json.Unmarshal(data, &index); err != nil {
		return nil, nil, err
	}
	for _, m := range index.Manifests {
		name := m.Annotations[images.AnnotationImageName]
		if name == "" {
			name = m.Annotations[ocispec.AnnotationRefName]
		}
		if name != "" {
			named = append(named, images.Image{Name: name, Target: m})
		}
	}
	if len(named) == 0 {
		return nil, nil, errors.New("the archive names no image")
	}
	return named, writes, nil
}

// importLayout imports the OCI image layout read from r into store, as containerd's
// archive.ImportIndex does (every regular file written as a blob, docker's manifest.json beside a
// layout left out, the layout's index.json returned), except that a blob whose name gives its
// digest (blobs/sha256/<encoded>) is written as that digest: containerd hashes every blob it
// stores and refuses to commit one whose bytes are not its digest, and ImportIndex hashed each
// blob again on this side (a second sha256 of every byte loaded, on the node's CPUs).
// A blob the store holds is not read at all: the tar reader seeks past it in an uncompressed
// archive.
func importLayout(ctx context.Context, store content.Ingester, r io.Reader) (ocispec.Descriptor, error) {
	tr := tar.NewReader(r)
	var layout ocispec.ImageLayout
	index, haveIndex := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex}, false
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return ocispec.Descriptor{}, err
		}
		if hdr.Typeflag != tar.TypeReg && hdr.Typeflag != tar.TypeRegA { //nolint:staticcheck // as ImportIndex: old tars write TypeRegA
			continue
		}
		name := path.Clean(hdr.Name)
		switch name {
		case ocispec.ImageLayoutFile:
			if err := json.NewDecoder(io.LimitReader(tr, layoutJSONLimit)).Decode(&layout); err != nil {
				return ocispec.Descriptor{}, fmt.Errorf("untar oci layout %q: %w", hdr.Name, err)
			}
			continue
		case "manifest.json":
			continue // docker's, beside the layout: the layout is what is imported
		}
		desc := ocispec.Descriptor{Size: hdr.Size}
		var src io.Reader = tr
		var dgstr digest.Digester
		if d, ok := layoutBlobDigest(name); ok {
			desc.Digest = d
		} else {
			dgstr = digest.Canonical.Digester()
			src = io.TeeReader(tr, dgstr.Hash())
		}
		err = content.WriteBlob(ctx, store, "tar-"+name, src, desc)
		if desc.Digest != "" && errdefs.IsFailedPrecondition(err) {
			return ocispec.Descriptor{}, fmt.Errorf("%s: its bytes are not the digest its name gives (a damaged archive): %w", name, err)
		} else if err != nil {
			return ocispec.Descriptor{}, fmt.Errorf("failed to ingest %q: %w", hdr.Name, err)
		}
		if name == ocispec.ImageIndexFile {
			index.Digest, index.Size, haveIndex = dgstr.Digest(), hdr.Size, true
		}
	}
	switch {
	case layout.Version == "":
		return ocispec.Descriptor{}, errors.New("not an OCI image layout: no oci-layout file")
	case layout.Version != ocispec.ImageLayoutVersion:
		return ocispec.Descriptor{}, fmt.Errorf("unsupported OCI version %s", layout.Version)
	case !haveIndex:
		return ocispec.Descriptor{}, fmt.Errorf("missing index.json in OCI layout %s", ocispec.ImageLayoutVersion)
	}
	return index, nil
}

// layoutBlobDigest is the digest an OCI layout's blob file name gives (blobs/sha256/<encoded>).
func layoutBlobDigest(name string) (digest.Digest, bool) {
	encoded, ok := strings.CutPrefix(name, "blobs/sha256/")
	d := digest.NewDigestFromEncoded(digest.SHA256, encoded)
	return d, ok && d.Validate() == nil
}

// layoutJSONLimit is how much of an oci-layout file is read, as containerd's import reads it.
const layoutJSONLimit = 20 << 20

// archiveImport is what containerd's import of one archive writes, as its content store
// (layerIndexStore) sees it. Each blob the archive's index describes (airgap.Content) is
// committed with the labels it needs (blobLabels): a cold load then writes no labels of its own.
// What the index cannot tell (an index from a record, a blob that was already there)
// labelContent labels after the import. The archive's own index, which only names the images, is
// kept here and not written: it is no image's content (the lease would take it away), and its
// write was two of containerd's transactions per archive. A cold load waits on them. As a
// content.Provider it reads the manifests and indexes it saw written from their bytes, and the
// rest from containerd: checking and labelling the imported images reads each of them again.
type archiveImport struct {
	im  *importer
	idx *airgap.Index

	mu        sync.Mutex
	committed map[digest.Digest]map[string]string // each blob's labels, as committed
	seen      map[digest.Digest][]byte            // manifests and indexes as written; the archive's own index
	heads     map[digest.Digest]blobHead          // the start of each blob committed, as written
}

// headSize is how much of each blob an import keeps: a small blob whole (a config, a small
// layer), and of a large layer what containerd's import reads to tell its compression (the 32 KiB
// its decompressor buffers).
const headSize = 32 << 10

// blobHead is the start of a blob the import committed, and its size.
type blobHead struct {
	data []byte
	size int64
}

func (ai *archiveImport) ReaderAt(ctx context.Context, desc ocispec.Descriptor) (content.ReaderAt, error) {
	ai.mu.Lock()
	data, ok := ai.seen[desc.Digest]
	head, committed := ai.heads[desc.Digest]
	ai.mu.Unlock()
	switch {
	case ok:
		return blobReader{bytes.NewReader(data)}, nil
	case committed:
		// Committed by this import, under its lease: there. What the head lacks is read from
		// containerd, if it is ever asked for.
		return &headReaderAt{head: head, open: func() (content.ReaderAt, error) { return ai.im.cd.Content.ReaderAt(ctx, desc) }}, nil
	}
	return ai.im.cd.Content.ReaderAt(ctx, desc)
}

// headReaderAt reads a blob from its head, and from containerd past it.
type headReaderAt struct {
	head blobHead
	open func() (content.ReaderAt, error)
	rest content.ReaderAt
}

func (r *headReaderAt) ReadAt(p []byte, off int64) (int, error) {
	whole := int64(len(r.head.data)) == r.head.size
	if off >= 0 && (off+int64(len(p)) <= int64(len(r.head.data)) || whole) {
		if off >= r.head.size {
			return 0, io.EOF
		}
		n := copy(p, r.head.data[off:])
		if n < len(p) {
			return n, io.EOF
		}
		return n, nil
	}
	if r.rest == nil {
		var err error
		if r.rest, err = r.open(); err != nil {
			return 0, err
		}
	}
	return r.rest.ReadAt(p, off)
}

func (r *headReaderAt) Size() int64 { return r.head.size }

func (r *headReaderAt) Close() error {
	if r.rest != nil {
		return r.rest.Close()
	}
	return nil
}

// writer opens the writer of containerd's import with opts: the blob committed with its labels,
// or, for the archive's own index, a writer that keeps its bytes here.
func (ai *archiveImport) writer(ctx context.Context, cs content.Store, opts []content.WriterOpt) (content.Writer, error) {
	var wo content.WriterOpts
	for _, opt := range opts {
		if err := opt(&wo); err != nil {
			return nil, err
		}
	}
	name, file := strings.CutPrefix(wo.Ref, "tar-")
	if file && name == ocispec.ImageIndexFile || strings.HasPrefix(wo.Ref, "manifest-") && images.IsIndexType(wo.Desc.MediaType) {
		// An OCI layout's index.json, or the index containerd writes for a docker archive.
		return &indexWriter{ai: ai, ref: wo.Ref, digester: digest.Canonical.Digester()}, nil
	}
	w, err := openWriter(ctx, cs, wo.Ref, opts, ai.im.writerStalled)
	if err != nil {
		return nil, err
	}
	// Every blob's start is kept (heads); the labels only where the archive's index tells them.
	lw := &labelledWriter{Writer: w, ai: ai}
	switch {
	case file && ai.idx.Content != nil:
		// A file of the archive: its images, and its children if it is a manifest or index.
		lw.refs = ai.idx.Content.Refs[name]
		lw.desc.MediaType = ai.idx.Content.MediaTypes[name]
		// Media types are an OCI layout's, whose blobs importLayout writes as the digests their
		// names give.
		lw.desc.Digest = wo.Desc.Digest
		if len(lw.refs) == 0 {
			lw.plain = true
		}
	case strings.HasPrefix(wo.Ref, "manifest-") && images.IsManifestType(wo.Desc.MediaType):
		// The manifest containerd writes for an image of a docker archive: the images with its
		// config (their image ID), once its bytes are read.
		lw.desc = wo.Desc
	default:
		lw.plain = true // a write the archive's index does not describe
	}
	if !lw.plain && (images.IsManifestType(lw.desc.MediaType) || images.IsIndexType(lw.desc.MediaType)) {
		if lw.desc.Digest == "" {
			lw.plain = true // its bytes cannot be checked against its name
		} else {
			lw.data = &bytes.Buffer{}
		}
	}
	return lw, nil
}

// indexWriter keeps the archive's own index in memory, for importTarball to read.
type indexWriter struct {
	ai       *archiveImport
	ref      string
	data     bytes.Buffer
	digester digest.Digester
}

func (w *indexWriter) Write(p []byte) (int, error) {
	w.data.Write(p)
	return w.digester.Hash().Write(p)
}

func (w *indexWriter) Commit(_ context.Context, size int64, expected digest.Digest, _ ...content.Opt) error {
	d := w.digester.Digest()
	if size > 0 && size != int64(w.data.Len()) || expected != "" && expected != d {
		return fmt.Errorf("%s: %d bytes of digest %s, want %d of %s", w.ref, w.data.Len(), d, size, expected)
	}
	w.ai.mu.Lock()
	defer w.ai.mu.Unlock()
	w.ai.seen[d] = w.data.Bytes()
	return nil
}

func (w *indexWriter) Status() (content.Status, error) {
	return content.Status{Ref: w.ref, Offset: int64(w.data.Len())}, nil
}

func (w *indexWriter) Digest() digest.Digest { return w.digester.Digest() }

func (w *indexWriter) Truncate(size int64) error {
	if size != 0 {
		return fmt.Errorf("%s: truncate to %d: only to 0", w.ref, size)
	}
	w.data.Reset()
	w.digester = digest.Canonical.Digester()
	return nil
}

func (w *indexWriter) Close() error { return nil }

// labelledWriter is a writer of containerd's import that commits its blob with its labels, and
// keeps the blob's start (archiveImport.heads).
type labelledWriter struct {
	content.Writer
	ai    *archiveImport
	plain bool               // no labels of its own: committed as containerd's import would
	refs  []string           // the images the blob is content of
	desc  ocispec.Descriptor // its media type and digest, when the name says it
	data  *bytes.Buffer      // a manifest's or index's bytes, whose children it names

	head    []byte // the first bytes written, up to headSize
	written int64  // bytes written from the blob's start; -1 once that is not known
}

func (w *labelledWriter) Write(p []byte) (int, error) {
	n, err := w.Writer.Write(p)
	if w.data != nil {
		w.data.Write(p[:n])
	}
	if w.written >= 0 {
		if w.written == int64(len(w.head)) && len(w.head) < headSize {
			w.head = append(w.head, p[:min(n, headSize-len(w.head))]...)
		}
		w.written += int64(n)
	}
	return n, err
}

// Truncate is content.Copy's restart of a write: what was kept of the bytes no longer is them.
func (w *labelledWriter) Truncate(size int64) error {
	if w.data != nil && size == 0 {
		w.data.Reset()
	} else {
		w.data = nil
	}
	if size == 0 {
		w.head, w.written = w.head[:0], 0
	} else {
		w.head, w.written = nil, -1
	}
	return w.Writer.Truncate(size)
}

func (w *labelledWriter) Commit(ctx context.Context, size int64, expected digest.Digest, opts ...content.Opt) error {
	labels, ok := w.labels()
	if ok {
		opts = append(opts, content.WithLabels(labels))
	}
	if err := w.Writer.Commit(ctx, size, expected, opts...); err != nil {
		return err
	}
	w.ai.mu.Lock()
	defer w.ai.mu.Unlock()
	d := w.Writer.Digest()
	if ok {
		w.ai.committed[d] = labels
		if w.data != nil {
			w.ai.seen[w.desc.Digest] = w.data.Bytes()
			return nil // kept whole: no head of it besides
		}
	}
	if size > 0 && w.written == size {
		// Written whole by this writer (a resumed write began past the start).
		w.ai.heads[d] = blobHead{data: w.head, size: size}
	}
	return nil
}

// labels are the blob's labels; false when it has none of its own, or they cannot be told: a
// manifest or index whose bytes were not all seen (a resumed write), or are not what its name says.
func (w *labelledWriter) labels() (map[string]string, bool) {
	if w.plain {
		return nil, false
	}
	if w.data == nil && (images.IsManifestType(w.desc.MediaType) || images.IsIndexType(w.desc.MediaType)) {
		return nil, false
	}
	var children []ocispec.Descriptor
	if w.data != nil {
		if digest.FromBytes(w.data.Bytes()) != w.desc.Digest {
			return nil, false
		}
		var err error
		if children, err = images.Children(context.Background(), oneBlob(w.data.Bytes()), w.desc); err != nil {
			return nil, false
		}
	}
	refs := w.refs
	if refs == nil && len(children) > 0 {
		// A docker archive's manifest is content of the images whose config it names.
		for _, img := range w.ai.idx.Images {
			if img.ImageID == children[0].Digest {
				refs = append(refs, img.Ref)
			}
		}
	}
	if len(refs) == 0 {
		return nil, false
	}
	return w.ai.im.blobLabels(refs, children), true
}

// oneBlob is a content.Provider of one blob's bytes, for images.Children to read what a writer saw.
type oneBlob []byte

func (b oneBlob) ReaderAt(context.Context, ocispec.Descriptor) (content.ReaderAt, error) {
	return blobReader{bytes.NewReader(b)}, nil
}

type blobReader struct{ *bytes.Reader }

func (blobReader) Close() error { return nil }
