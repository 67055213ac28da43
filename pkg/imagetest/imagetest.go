// Package imagetest writes air-gap archives the way users make them, for tests and the demo:
// random images (with os/arch set: containerd's importer filters out images without them) saved
// as docker archives (manifest.json, as `docker save`) or OCI image-layout archives (index.json,
// with multi-platform indexes), in every compression k3s loads, chosen by the file's ending.
package imagetest

import (
	"archive/tar"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/distribution/reference"
	"github.com/dsnet/compress/bzip2"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4"
)

// Image returns a random image for os/arch whose one layer holds about size bytes.
func Image(size int64, platform v1.Platform) (v1.Image, error) {
	layer, err := random.Layer(size, types.DockerLayer)
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return nil, err
	}
	return Configure(img, platform, func(cf *v1.ConfigFile) { cf.Config.Cmd = []string{"/bin/true"} })
}

// Configure is img for platform (containerd's importer filters out images without one), with
// edit applied to a copy of its config.
func Configure(img v1.Image, platform v1.Platform, edit func(*v1.ConfigFile)) (v1.Image, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Variant = platform.OS, platform.Architecture, platform.Variant
	edit(cf)
	return mutate.ConfigFile(img, cf)
}

// Amd64 is the node's platform on these machines.
var Amd64 = v1.Platform{OS: "linux", Architecture: "amd64"}

// MultiPlatform returns an index of one random image per platform.
func MultiPlatform(size int64, platforms ...v1.Platform) (v1.ImageIndex, error) {
	var adds []mutate.IndexAddendum
	for _, p := range platforms {
		img, err := Image(size, p)
		if err != nil {
			return nil, err
		}
		p := p
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
	}
	return mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex), adds...), nil
}

// WriteDocker writes a docker archive holding each image under its tag(s).
func WriteDocker(path string, tags map[string]v1.Image) error {
	refs := map[name.Reference]v1.Image{}
	for tag, img := range tags {
		t, err := name.NewTag(tag)
		if err != nil {
			return err
		}
		refs[t] = img
	}
	return writeCompressed(path, func(w io.Writer) error { return tarball.MultiRefWrite(refs, w) })
}

// WriteOCI writes an OCI image-layout archive. Each entry (a v1.Image or v1.ImageIndex) is named
// as `docker save` names it: io.containerd.image.name with the full reference, and
// org.opencontainers.image.ref.name with the tag.
func WriteOCI(path string, entries map[string]any) error {
	dir, err := os.MkdirTemp("", "oci-layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	for ref, e := range entries {
		t, err := name.NewTag(ref)
		if err != nil {
			return err
		}
		// containerd's name: docker.io/..., where go-containerregistry says index.docker.io/...
		full, err := reference.ParseDockerRef(ref)
		if err != nil {
			return err
		}
		ann := layout.WithAnnotations(map[string]string{
			"io.containerd.image.name":          full.String(),
			"org.opencontainers.image.ref.name": t.TagStr(),
		})
		switch v := e.(type) {
		case v1.Image:
			err = lp.AppendImage(v, ann)
		case v1.ImageIndex:
			err = lp.AppendIndex(v, ann)
		default:
			err = fmt.Errorf("entry %s: %T is neither an image nor an index", ref, e)
		}
		if err != nil {
			return err
		}
	}
	return writeCompressed(path, func(w io.Writer) error { return tarDir(dir, w) })
}

func tarDir(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		hdr, err := tar.FileInfoHeader(info, "")
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(hdr); err != nil || info.IsDir() {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(tw, f)
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// Extensions are the tarball endings k3s loads, one per compression.
var Extensions = []string{".tar", ".tar.gz", ".tgz", ".tar.zst", ".tzst", ".tar.bz2", ".tbz", ".tar.lz4"}

// writeCompressed creates path, compressed as its ending says, and fills it with write.
func writeCompressed(path string, write func(io.Writer) error) (err error) {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	var zw io.WriteCloser
	lower := strings.ToLower(path)
	switch {
	case strings.HasSuffix(lower, ".tar"):
		return write(f)
	case strings.HasSuffix(lower, ".tar.gz"), strings.HasSuffix(lower, ".tgz"):
		zw = gzip.NewWriter(f)
	case strings.HasSuffix(lower, ".tar.zst"), strings.HasSuffix(lower, ".tzst"):
		if zw, err = zstd.NewWriter(f); err != nil {
			return err
		}
	case strings.HasSuffix(lower, ".tar.bz2"), strings.HasSuffix(lower, ".tbz"):
		if zw, err = bzip2.NewWriter(f, nil); err != nil {
			return err
		}
	case strings.HasSuffix(lower, ".tar.lz4"):
		zw = lz4.NewWriter(f)
	default:
		return fmt.Errorf("%s: no tarball ending k3s loads", path)
	}
	if err := write(zw); err != nil {
		return err
	}
	return zw.Close()
}

// CountingFile is an archive file that counts the bytes read from it: a tar reader that seeks
// past an entry (the file is an io.Seeker) reads none of it, which is what tests of an archive
// read without its layers measure.
type CountingFile struct {
	*os.File
	BytesRead int64
}

func (f *CountingFile) Read(p []byte) (int, error) {
	n, err := f.File.Read(p)
	f.BytesRead += int64(n)
	return n, err
}
