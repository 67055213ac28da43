// Command release-image writes the k3s-pinning image for air-gapped nodes: one OCI image index
// over the static binaries of make release (no base image: a static binary needs none), saved as
// an OCI image-layout archive that an operator drops into k3s's agent/images, where k3s-pinning
// then protects its own image like every other air-gap image. No Docker engine is involved.
//
//	release-image -ref docker.io/k3s-pinning/k3s-pinning:v0.1.0 -out dist/k3s-pinning-image.tar \
//	    linux/amd64=dist/k3s-pinning-linux-amd64 linux/arm64=... linux/arm/v7=...
package main

import (
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

func main() {
	ref := flag.String("ref", "", "the image's reference, as the DaemonSet names it")
	out := flag.String("out", "", "the archive to write")
	version := flag.String("version", "dev", "org.opencontainers.image.version")
	flag.Parse()
	if *ref == "" || *out == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: release-image -ref REF -out FILE os/arch[/variant]=BINARY...")
		os.Exit(2)
	}
	if err := write(*ref, *out, *version, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "release-image:", err)
		os.Exit(1)
	}
}

func write(ref, out, version string, binaries []string) error {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, arg := range binaries {
		plat, path, ok := strings.Cut(arg, "=")
		if !ok {
			return fmt.Errorf("%q: want os/arch[/variant]=BINARY", arg)
		}
		p, err := v1.ParsePlatform(plat)
		if err != nil {
			return fmt.Errorf("%q: %w", plat, err)
		}
		img, err := image(path, *p, version)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: p}})
	}
	return imagetest.WriteOCI(out, map[string]any{ref: idx})
}

// image is the binary at path as /k3s-pinning, run as `k3s-pinning run`, for platform p.
func image(path string, p v1.Platform, version string) (v1.Image, error) {
	bin, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	// A fixed time: the same binary gives the same layer, and so the same image digest.
	epoch := time.Unix(0, 0)
	if err := tw.WriteHeader(&tar.Header{Name: "k3s-pinning", Mode: 0o755, Size: int64(len(bin)), ModTime: epoch, Typeflag: tar.TypeReg}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(bin); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := layer.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(mutate.MediaType(mutate.ConfigMediaType(empty.Image, types.OCIConfigJSON), types.OCIManifestSchema1),
		mutate.Addendum{Layer: l, History: v1.History{CreatedBy: "k3s-pinning make release", Created: v1.Time{Time: epoch}}})
	if err != nil {
		return nil, err
	}
	return imagetest.Configure(img, p, func(cf *v1.ConfigFile) {
		cf.Created = v1.Time{Time: epoch}
		cf.Config.Entrypoint = []string{"/k3s-pinning"}
		cf.Config.Cmd = []string{"run"}
		cf.Config.Labels = map[string]string{
			"org.opencontainers.image.title":   "k3s-pinning",
			"org.opencontainers.image.version": version,
			"org.opencontainers.image.source":  "https://github.com/k3s-pinning/k3s-pinning",
		}
	})
}
