package airgap

import (
	"archive/tar"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/pierrec/lz4/v4"
	"github.com/rancher/wharfie/pkg/tarfile"
)

// Format is the kind of content an archive holds.
type Format string

const (
	DockerArchive Format = "docker-archive" // manifest.json, as `docker save` writes
	OCIArchive    Format = "oci-archive"    // OCI image layout: oci-layout + index.json
	ImageList     Format = "list"           // .txt: one reference a line, pulled through the CRI
)

// Index is what one archive provides, read without importing it.
type Index struct {
	Archive Archive
	Format  Format
	Images  []IndexedImage
	// Content is what the archive's files are to its images; nil for a .txt list, and for an
	// index that was recorded rather than read.
	Content *Content
}

// Content is what each file of an image archive is to the archive's images, by the file's name
// in the archive: containerd's import writes one blob per file, and this lets it label each blob
// in the write that creates it, rather than in a write of its own (a cold load waits on
// containerd's transactions).
type Content struct {
	// Refs are the references (IndexedImage.Ref) whose content the file is: a docker archive's
	// configs and layers, every blob an OCI layout's named descriptors reach, on any platform.
	Refs map[string][]string
	// MediaTypes are the media types of an OCI layout's manifest and index files (the files
	// whose children containerd's GC must keep with them), as their descriptors give them.
	MediaTypes map[string]string
}

// add records that the file name is content of ref.
func (c *Content) add(name, ref string) {
	if !slices.Contains(c.Refs[name], ref) {
		c.Refs[name] = append(c.Refs[name], ref)
	}
}

// IndexedImage is one named image an archive provides.
type IndexedImage struct {
	// Ref is the reference as containerd will name it (docker tags are normalized, so "app:1"
	// is docker.io/library/app:1).
	Ref string
	// Digest is what Ref will point at: the manifest or index digest of an OCI layout. A docker
	// archive has no manifest (containerd writes one at import), so it is empty until imported.
	Digest digest.Digest
	// ImageID is the config digest for the node's platform: the image ID of the CRI and kubelet.
	// Empty for list entries until pulled.
	ImageID digest.Digest
	// Line is the 1-based line of a .txt list entry.
	Line int
}

const (
	// maxMetadataEntry bounds one JSON entry (manifest, index, config) kept while indexing;
	// larger entries are layers and are only counted.
	maxMetadataEntry = 4 << 20
	// maxMetadataTotal bounds all JSON kept for one archive.
	maxMetadataTotal = 64 << 20
	// maxListLine bounds one line of a .txt list (a reference is at most 255 bytes of name, a
	// tag and a digest).
	maxListLine = 4096
	// maxListEntries bounds the distinct references of one list, and maxListBytes what is read
	// of it: k3s pulls each entry, and a list is meant for a handful of images.
	maxListEntries = 10000
	maxListBytes   = 16 << 20
	// maxListErrors bounds the bad lines reported one by one for one list (each is a `doctor`
	// finding and a log line).
	maxListErrors = 20
	// maxEntryName bounds one tar entry's name (PATH_MAX): image tools write names of a digest
	// and a few words, and a tar's PAX or GNU header may carry a name of up to a megabyte.
	maxEntryName = 4096
	// maxEntries and maxEntryNames bound the entries of one tarball and the bytes of their names,
	// which the index keeps until it is read whole: an image archive holds a few entries per
	// image, each named by a digest, so these leave room for tens of thousands of images.
	maxEntries    = 200_000
	maxEntryNames = 16 << 20
)

// MaxExpansion bounds what a compressed archive may expand to: MaxExpansion times its size on
// disk, plus expansionSlack. Image tarballs compress a few times at most (their layers are
// usually compressed already); a decompression bomb expands thousands of times, and would fill
// the disk holding containerd's root, the very disk the kubelet is trying to free. A genuine
// archive over the bound can be stored uncompressed (.tar), which is never over it.
const (
	MaxExpansion   = 100
	expansionSlack = 64 << 20
)

// ExpandedLimit is the most bytes archive a may yield once decompressed.
func ExpandedLimit(a Archive) int64 { return MaxExpansion*a.Size + expansionSlack }

// Opener yields an archive's content, as go-containerregistry's tarball.Opener: for a tarball the
// tar stream, decompressed; for a .txt list its text. It may be called more than once (to index,
// then to import).
type Opener func() (io.ReadCloser, error)

// FileOpener opens the file a names, decompressed as k3s does (its decoders, with the zstd
// decoder memory bound k3s uses), yielding at most ExpandedLimit(a) bytes: past that, reads fail
// with an error naming the bound.
func FileOpener(a Archive) Opener {
	if a.IsList() {
		return func() (io.ReadCloser, error) { return os.Open(a.Path) }
	}
	return func() (io.ReadCloser, error) {
		open, err := tarfile.GetOpener(a.Path)
		if err != nil {
			return nil, err
		}
		if strings.HasSuffix(strings.ToLower(a.Path), ".tar.lz4") {
			open = openLZ4(a.Path)
		}
		rc, err := open()
		if err != nil {
			return nil, err
		}
		if f, ok := rc.(*os.File); ok {
			// An uncompressed archive yields its own bytes, never more than its size: the file
			// itself, which the tar reader seeks through (an index skips its layers unread).
			return f, nil
		}
		return &boundedReader{ReadCloser: rc, left: ExpandedLimit(a), limit: ExpandedLimit(a)}, nil
	}
}

// openLZ4 opens an lz4 frame with pierrec/lz4 v4. wharfie decodes with v2, whose amd64 block
// decoder rejects some valid frames ("invalid source or destination buffer too short"; the frame
// in testdata/v2-rejects.tar.lz4, which v4 and v2's portable decoder read): an archive k3s itself
// cannot load, where the format is the same.
func openLZ4(path string) func() (io.ReadCloser, error) {
	return func() (io.ReadCloser, error) {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		return tarfile.SplitReadCloser(lz4.NewReader(f), f), nil
	}
}

// boundedReader fails once more than limit bytes were read.
type boundedReader struct {
	io.ReadCloser
	left, limit int64
}

func (b *boundedReader) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, errTooExpanded(b.limit)
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

func errTooExpanded(limit int64) error {
	return fmt.Errorf("expands to more than %d MiB (%d times its size plus %d MiB): refused as a decompression bomb; store a genuine archive uncompressed (.tar)",
		limit>>20, MaxExpansion, expansionSlack>>20)
}

// ReadFile is Read of the file a names.
func ReadFile(a Archive) (*Index, digest.Digest, error) { return Read(a, FileOpener(a)) }

// Read reads what archive a provides through open, and the sha256 of what open yields (the tar
// stream, or the list's text), in one pass: the digest tells a touched archive (same content, new
// mtime) from a replaced one. A .txt list with some bad lines returns the good ones with an error
// naming each bad line; any other error means the archive cannot be imported. Every error names
// a's path.
func Read(a Archive, open Opener) (*Index, digest.Digest, error) {
	h := sha256.New()
	idx, err := read(a, open, h)
	if idx == nil {
		return nil, "", err
	}
	return idx, digest.NewDigest(digest.SHA256, h), err
}

// ReadIndex is Read without the digest, for an archive with nothing recorded to compare it with:
// it reads only what the index needs, and of an uncompressed archive only its metadata (the tar
// reader seeks past each layer), where Read reads and hashes it whole.
func ReadIndex(a Archive, open Opener) (*Index, error) { return read(a, open, nil) }

// read is Read, hashing what open yields into h unless h is nil.
func read(a Archive, open Opener, h hash.Hash) (*Index, error) {
	rc, err := open()
	if err != nil {
		return nil, &ArchiveError{Path: a.Path, Err: err}
	}
	defer rc.Close()
	var r io.Reader = rc
	if h != nil {
		r = io.TeeReader(rc, h)
	}
	var idx *Index
	if a.IsList() {
		idx, err = readList(a, r)
	} else {
		idx, err = readTar(a, r)
		if errors.Is(err, zstd.ErrWindowSizeExceeded) {
			err = fmt.Errorf("%w: its zstd window is larger than the %d MiB the decoder may use (k3s's bound); compress with a smaller window (zstd --long=25 or less)",
				err, tarfile.MaxDecoderMemory>>20)
		}
		if err != nil {
			return nil, &ArchiveError{Path: a.Path, Err: err}
		}
	}
	if idx == nil {
		return nil, err
	}
	// The tar reader stops at the end-of-archive marker: the padding after it is content too. A
	// list is hashed as far as it is read (maxListBytes).
	if h != nil && !a.IsList() {
		if _, err := io.Copy(io.Discard, r); err != nil {
			return nil, &ArchiveError{Path: a.Path, Err: fmt.Errorf("reading to the end: %w", err)}
		}
	}
	return idx, err
}

func readList(a Archive, text io.Reader) (*Index, error) {
	idx := &Index{Archive: a, Format: ImageList}
	var errs []error
	bad := func(line int, err error) {
		if len(errs) < maxListErrors {
			errs = append(errs, &ArchiveError{Path: a.Path, Line: line, Err: err})
		}
		if len(errs) == maxListErrors {
			errs = append(errs, &ArchiveError{Path: a.Path, Err: fmt.Errorf("more than %d bad lines; the rest are not reported one by one", maxListErrors)})
		}
	}
	listed := map[string]bool{}
	r := bufio.NewReaderSize(io.LimitReader(text, maxListBytes+1), maxListLine)
	for line := 1; ; line++ {
		text, long, err := readLine(r)
		if err != nil && err != io.EOF {
			bad(line, fmt.Errorf("unreadable: %w", err))
			break
		}
		if long {
			bad(line, fmt.Errorf("longer than %d bytes: not an image reference", maxListLine))
		} else if text = strings.TrimSpace(text); text != "" && !strings.HasPrefix(text, "#") {
			switch named, perr := reference.ParseDockerRef(text); {
			case perr != nil:
				bad(line, notAReference(text, perr))
			case listed[named.String()]:
				// listed twice: pulled once
			case len(listed) == maxListEntries:
				bad(line, fmt.Errorf("more than %d references in one list: the rest are ignored", maxListEntries))
				return idx, errors.Join(errs...)
			default:
				listed[named.String()] = true
				img := IndexedImage{Ref: named.String(), Line: line}
				if c, ok := named.(reference.Canonical); ok {
					img.Digest = c.Digest()
				}
				idx.Images = append(idx.Images, img)
			}
		}
		if err == io.EOF {
			break
		}
	}
	if a.Size > maxListBytes {
		errs = append(errs, &ArchiveError{Path: a.Path, Err: fmt.Errorf("larger than %d MiB: only the beginning was read", maxListBytes>>20)})
	}
	return idx, errors.Join(errs...)
}

// readLine returns the next line of r without its newline; a line longer than r's buffer is
// skipped to its end and reported as long, so that one huge line costs nothing and the lines
// after it are still read.
func readLine(r *bufio.Reader) (text string, long bool, err error) {
	for {
		chunk, err := r.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			long = true
			continue
		}
		if !long {
			text = strings.TrimSuffix(string(chunk), "\n")
		}
		if err == io.EOF && len(chunk) == 0 && !long {
			return "", false, io.EOF
		}
		return text, long, err
	}
}

// notAReference explains a bad list line. The parser's own message repeats the line, so it is
// kept only for a short printable one.
func notAReference(text string, err error) error {
	if len(text) > 80 || strings.ContainsFunc(text, func(r rune) bool { return !strconv.IsPrint(r) }) {
		return fmt.Errorf("%s is not an image reference", quoteShort(text))
	}
	return fmt.Errorf("%s is not an image reference: %w", quoteShort(text), err)
}

// quoteShort quotes s for an error message, cut to a length that keeps logs readable (a list may
// hold binary junk).
func quoteShort(s string) string {
	const max = 80
	if len(s) > max {
		return strconv.Quote(s[:max]) + "..."
	}
	return strconv.Quote(s)
}

// tarContents is what one pass over an image tarball keeps: which entries exist and the JSON
// ones small enough to be metadata.
type tarContents struct {
	present   map[string]bool
	json      map[string][]byte
	symlinks  map[string]string
	hardlinks map[string]bool
	kept      int64
}

// escapes reports whether the cleaned entry name leaves the archive's root.
func escapes(name string) bool {
	return path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../")
}

func readTar(a Archive, r io.Reader) (*Index, error) {
	tc := &tarContents{present: map[string]bool{}, json: map[string][]byte{}, symlinks: map[string]string{}, hardlinks: map[string]bool{}}
	tr := tar.NewReader(r)
	limit, total := ExpandedLimit(a), int64(0)
	entries, names := 0, 0
	var head [512]byte
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading tar: %w", err)
		}
		// Every name is kept until the archive is read whole (present, symlinks): a crafted
		// archive of many entries, or of long names, is refused before it costs the node's memory.
		entries, names = entries+1, names+len(hdr.Name)+len(hdr.Linkname)
		switch {
		case len(hdr.Name) > maxEntryName || len(hdr.Linkname) > maxEntryName:
			return nil, fmt.Errorf("entry %d has a name of %d bytes, over the %d an image tool writes: refused", entries, max(len(hdr.Name), len(hdr.Linkname)), maxEntryName)
		case entries > maxEntries:
			return nil, fmt.Errorf("more than %d entries: refused (an image archive holds a few per image)", maxEntries)
		case names > maxEntryNames:
			return nil, fmt.Errorf("more than %d MiB of entry names: refused", maxEntryNames>>20)
		}
		// containerd stores entries by content digest and never writes them by name, so a name
		// cannot reach outside; but no image tool writes such names, and an archive that does was
		// crafted: it is refused whole.
		name := path.Clean(hdr.Name)
		if escapes(name) {
			return nil, fmt.Errorf("entry %q points outside the archive: refused", hdr.Name)
		}
		switch hdr.Typeflag {
		case tar.TypeSymlink:
			target := path.Join(path.Dir(name), hdr.Linkname)
			if path.IsAbs(hdr.Linkname) || escapes(target) {
				return nil, fmt.Errorf("symlink %q -> %q points outside the archive: refused", hdr.Name, hdr.Linkname)
			}
			tc.symlinks[name] = target
			continue
		case tar.TypeLink:
			tc.hardlinks[name] = true // containerd's importer ignores hard links
			continue
		case tar.TypeReg:
		default:
			continue
		}
		// Sizes are checked before the data is read: a sparse entry (a few bytes in the file, any
		// size once read) or a bomb is refused without expanding it.
		if total += hdr.Size; total > limit {
			return nil, errTooExpanded(limit)
		}
		tc.present[name] = true
		if hdr.Size > maxMetadataEntry {
			continue // the next header skips it: read (and hashed) through, or sought past
		}
		// Only JSON is kept: what an entry begins with decides, and the rest of one that is not
		// (a layer) is skipped, not read into memory (reading every entry whole was a quarter of
		// what a first sync allocated).
		n, err := io.ReadFull(tr, head[:min(hdr.Size, int64(len(head)))])
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", name, err)
		}
		lead := bytes.TrimSpace(head[:n])
		if name != "manifest.json" && (len(lead) > 0 && lead[0] != '{' || len(lead) == 0 && int64(n) == hdr.Size) {
			continue
		}
		data := make([]byte, hdr.Size)
		copy(data, head[:n])
		if _, err := io.ReadFull(tr, data[n:]); err != nil {
			return nil, fmt.Errorf("reading %s: %w", name, err)
		}
		if len(bytes.TrimSpace(data)) > 0 && bytes.TrimSpace(data)[0] == '{' || name == "manifest.json" {
			if tc.kept += int64(len(data)); tc.kept > maxMetadataTotal {
				return nil, fmt.Errorf("more than %d MiB of metadata", maxMetadataTotal>>20)
			}
			tc.json[name] = data
		}
	}
	for name, target := range tc.symlinks {
		if tc.present[target] {
			tc.present[name] = true
		}
	}
	// Like containerd's importer: an OCI layout wins over a docker manifest.json.
	if _, ok := tc.json[ocispec.ImageLayoutFile]; ok {
		return tc.ociIndex(a)
	}
	if _, ok := tc.json["manifest.json"]; ok {
		return tc.dockerIndex(a)
	}
	return nil, errors.New("not an image archive: no manifest.json and no OCI layout (oci-layout, index.json)")
}

// hardlinkNote explains a missing entry that is a hard link.
func (tc *tarContents) hardlinkNote(name string) string {
	if tc.hardlinks[path.Clean(name)] {
		return " (it is a hard link, which containerd does not import)"
	}
	return ""
}

func (tc *tarContents) decode(name string, v any) error {
	data, ok := tc.json[name]
	if !ok {
		if tc.present[name] {
			return fmt.Errorf("%s is not JSON or too large", name)
		}
		return fmt.Errorf("%s is missing from the archive%s", name, tc.hardlinkNote(name))
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

func (tc *tarContents) dockerIndex(a Archive) (*Index, error) {
	var manifests []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := tc.decode("manifest.json", &manifests); err != nil {
		return nil, err
	}
	idx := &Index{Archive: a, Format: DockerArchive, Content: &Content{Refs: map[string][]string{}}}
	for i, m := range manifests {
		config, ok := tc.json[path.Clean(m.Config)]
		if !ok {
			return nil, fmt.Errorf("manifest.json entry %d: config %q is missing from the archive", i, m.Config)
		}
		for _, l := range m.Layers {
			if !tc.present[path.Clean(l)] {
				return nil, fmt.Errorf("manifest.json entry %d: layer %q is missing from the archive%s", i, l, tc.hardlinkNote(l))
			}
		}
		id := digest.FromBytes(config)
		for _, tag := range m.RepoTags {
			named, err := reference.ParseDockerRef(tag)
			if err != nil {
				return nil, fmt.Errorf("manifest.json entry %d: tag %q: %w", i, tag, err)
			}
			ref := named.String()
			idx.Images = append(idx.Images, IndexedImage{Ref: ref, ImageID: id})
			// As containerd's import finds the files: a layer named by a symlink is its target's.
			for _, name := range append([]string{m.Config}, m.Layers...) {
				name = path.Clean(name)
				if target, ok := tc.symlinks[name]; ok {
					name = target
				}
				idx.Content.add(name, ref)
			}
		}
	}
	return idx, nil
}

func blobPath(d digest.Digest) string { return path.Join("blobs", d.Algorithm().String(), d.Encoded()) }

func (tc *tarContents) ociIndex(a Archive) (*Index, error) {
	var layout ocispec.ImageLayout
	if err := tc.decode(ocispec.ImageLayoutFile, &layout); err != nil {
		return nil, err
	}
	if layout.Version != ocispec.ImageLayoutVersion {
		return nil, fmt.Errorf("unsupported OCI layout version %q", layout.Version)
	}
	var index ocispec.Index
	if err := tc.decode(ocispec.ImageIndexFile, &index); err != nil {
		return nil, err
	}
	idx := &Index{Archive: a, Format: OCIArchive, Content: &Content{Refs: map[string][]string{}, MediaTypes: map[string]string{}}}
	for _, desc := range index.Manifests {
		name := desc.Annotations[images.AnnotationImageName]
		if name == "" {
			name = desc.Annotations[ocispec.AnnotationRefName]
		}
		if name == "" {
			continue // containerd creates no image for an unnamed descriptor
		}
		if err := desc.Digest.Validate(); err != nil {
			return nil, fmt.Errorf("index.json: %s: %w", name, err)
		}
		id, err := tc.imageID(desc, 0)
		if err != nil {
			return nil, fmt.Errorf("index.json: %s: %w", name, err)
		}
		idx.Images = append(idx.Images, IndexedImage{Ref: name, Digest: desc.Digest, ImageID: id})
		tc.walkContent(idx.Content, desc, name, 0)
	}
	return idx, nil
}

// walkContent records the blobs desc reaches in the archive as content of ref, on every platform
// (containerd's import keeps them all): what the archive lacks is left out, as the import leaves it.
func (tc *tarContents) walkContent(c *Content, desc ocispec.Descriptor, ref string, depth int) {
	name := blobPath(desc.Digest)
	if !tc.present[name] || depth > 4 {
		return
	}
	c.add(name, ref)
	var children []ocispec.Descriptor
	switch {
	case images.IsIndexType(desc.MediaType):
		c.MediaTypes[name] = desc.MediaType
		var index ocispec.Index
		if tc.decode(name, &index) != nil {
			return
		}
		children = index.Manifests
	case images.IsManifestType(desc.MediaType):
		c.MediaTypes[name] = desc.MediaType
		var m ocispec.Manifest
		if tc.decode(name, &m) != nil {
			return
		}
		children = append([]ocispec.Descriptor{m.Config}, m.Layers...)
	default:
		return
	}
	for _, child := range children {
		tc.walkContent(c, child, ref, depth+1)
	}
}

// imageID resolves desc (a manifest or an index) to the config digest for the node's platform,
// checking that this platform's config and layers are all in the archive.
func (tc *tarContents) imageID(desc ocispec.Descriptor, depth int) (digest.Digest, error) {
	if depth > 4 {
		return "", errors.New("image index nested too deep")
	}
	switch desc.MediaType {
	case ocispec.MediaTypeImageIndex, images.MediaTypeDockerSchema2ManifestList:
		var index ocispec.Index
		if err := tc.decode(blobPath(desc.Digest), &index); err != nil {
			return "", err
		}
		match := platforms.Default()
		for _, m := range index.Manifests {
			if m.Platform == nil || match.Match(*m.Platform) {
				return tc.imageID(m, depth+1)
			}
		}
		return "", fmt.Errorf("no manifest for platform %s in index %s", platforms.DefaultString(), desc.Digest)
	case ocispec.MediaTypeImageManifest, images.MediaTypeDockerSchema2Manifest:
		var m ocispec.Manifest
		if err := tc.decode(blobPath(desc.Digest), &m); err != nil {
			return "", err
		}
		if !tc.present[blobPath(m.Config.Digest)] {
			return "", fmt.Errorf("config %s is missing from the archive%s", m.Config.Digest, tc.hardlinkNote(blobPath(m.Config.Digest)))
		}
		for _, l := range m.Layers {
			if !tc.present[blobPath(l.Digest)] {
				return "", fmt.Errorf("layer %s is missing from the archive%s", l.Digest, tc.hardlinkNote(blobPath(l.Digest)))
			}
		}
		return m.Config.Digest, nil
	default:
		return "", fmt.Errorf("unsupported media type %q", desc.MediaType)
	}
}
