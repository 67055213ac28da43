package images

import (
	"archive/tar"
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
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

func digestRef(ref string, dgst digest.Digest) string {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil || dgst == "" {
		return ""
	}
	c, err := reference.WithDigest(reference.TrimNamed(named), dgst)
	if err != nil {
		return ""
	}
	return c.String()
}

const (
	// maxMetadataEntry bounds one JSON entry (manifest, index, config) kept while indexing;
	// larger entries are layers and are only counted.
	maxMetadataEntry = 4 << 20
	// maxMetadataTotal bounds all JSON kept for one archive.
	maxMetadataTotal = 64 << 20
	// maxListLine bounds one line of a .txt list.
	maxListLine = 4096
)

// ReadIndex reads what archive a provides. A .txt list with some bad lines returns the good ones
// with an error naming each bad line; any other error means the archive cannot be imported.
func ReadIndex(a Archive) (*Index, error) {
	if a.IsList() {
		return readList(a)
	}
	open, err := tarfile.GetOpener(a.Path)
	if err != nil {
		return nil, &ArchiveError{Path: a.Path, Err: err}
	}
	rc, err := open()
	if err != nil {
		return nil, &ArchiveError{Path: a.Path, Err: err}
	}
	defer rc.Close()
	idx, err := readTar(a, rc)
	if err != nil {
		return nil, &ArchiveError{Path: a.Path, Err: err}
	}
	return idx, nil
}

func readList(a Archive) (*Index, error) {
	f, err := os.Open(a.Path)
	if err != nil {
		return nil, &ArchiveError{Path: a.Path, Err: err}
	}
	defer f.Close()
	idx := &Index{Archive: a, Format: ImageList}
	var errs []error
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, maxListLine), maxListLine)
	line := 0
	for sc.Scan() {
		line++
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		named, err := reference.ParseDockerRef(text)
		if err != nil {
			errs = append(errs, &ArchiveError{Path: a.Path, Line: line, Err: fmt.Errorf("%q is not an image reference: %w", text, err)})
			continue
		}
		img := IndexedImage{Ref: named.String(), Line: line}
		if c, ok := named.(reference.Canonical); ok {
			img.Digest = c.Digest()
		}
		idx.Images = append(idx.Images, img)
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, &ArchiveError{Path: a.Path, Line: line + 1, Err: fmt.Errorf("unreadable line: %w", err)})
	}
	return idx, errors.Join(errs...)
}

// tarContents is what one pass over an image tarball keeps: which entries exist and the JSON
// ones small enough to be metadata.
type tarContents struct {
	present  map[string]bool
	json     map[string][]byte
	symlinks map[string]string
	kept     int64
}

func readTar(a Archive, r io.Reader) (*Index, error) {
	tc := &tarContents{present: map[string]bool{}, json: map[string][]byte{}, symlinks: map[string]string{}}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("reading tar: %w", err)
		}
		name := path.Clean(hdr.Name)
		switch hdr.Typeflag {
		case tar.TypeSymlink:
			tc.symlinks[name] = path.Join(path.Dir(name), hdr.Linkname)
			continue
		case tar.TypeReg:
		default:
			continue
		}
		tc.present[name] = true
		if hdr.Size > maxMetadataEntry {
			if _, err := io.Copy(io.Discard, tr); err != nil {
				return nil, fmt.Errorf("reading %s: %w", name, err)
			}
			continue
		}
		data, err := io.ReadAll(tr)
		if err != nil {
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

func (tc *tarContents) decode(name string, v any) error {
	data, ok := tc.json[name]
	if !ok {
		if tc.present[name] {
			return fmt.Errorf("%s is not JSON or too large", name)
		}
		return fmt.Errorf("%s is missing from the archive", name)
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
	idx := &Index{Archive: a, Format: DockerArchive}
	for i, m := range manifests {
		config, ok := tc.json[path.Clean(m.Config)]
		if !ok {
			return nil, fmt.Errorf("manifest.json entry %d: config %q is missing from the archive", i, m.Config)
		}
		for _, l := range m.Layers {
			if !tc.present[path.Clean(l)] {
				return nil, fmt.Errorf("manifest.json entry %d: layer %q is missing from the archive", i, l)
			}
		}
		id := digest.FromBytes(config)
		for _, tag := range m.RepoTags {
			named, err := reference.ParseDockerRef(tag)
			if err != nil {
				return nil, fmt.Errorf("manifest.json entry %d: tag %q: %w", i, tag, err)
			}
			idx.Images = append(idx.Images, IndexedImage{Ref: named.String(), ImageID: id})
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
	idx := &Index{Archive: a, Format: OCIArchive}
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
	}
	return idx, nil
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
			return "", fmt.Errorf("config %s is missing from the archive", m.Config.Digest)
		}
		for _, l := range m.Layers {
			if !tc.present[blobPath(l.Digest)] {
				return "", fmt.Errorf("layer %s is missing from the archive", l.Digest)
			}
		}
		return m.Config.Digest, nil
	default:
		return "", fmt.Errorf("unsupported media type %q", desc.MediaType)
	}
}
