package images

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// TestUnpinReadsAndWritesTheStateInOneTurn: `k3s-pinning unpin` drops a retained archive's
// references by reading the state file, changing it and writing it back; a save by the running
// agent that falls between its read and its write must not be lost (nor one of unpin's lost to
// the agent's). Here the other writer holds the state lock while unpin starts, and saves an
// archive it retained meanwhile: unpin waits for the turn, and both changes are on file.
func TestUnpinReadsAndWritesTheStateInOneTurn(t *testing.T) {
	d := containerdtest.New(t, containerdtest.Options{})
	client, err := d.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ctx := namespaces.WithNamespace(t.Context(), pinning.DefaultNamespace)
	const kept, other = "retain.example/kept:1.0", "retain.example/other:1.0"
	target := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromString(kept), Size: 1}
	if _, err := client.ImageService().Create(ctx, images.Image{Name: kept, Target: target, Labels: pinning.PinLabels("kept.tar")}); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "state", "state.json")
	s := statefile.New()
	s.Retained["kept.tar"] = &statefile.Archive{Refs: map[string]digest.Digest{kept: target.Digest}}
	if err := s.Save(path); err != nil {
		t.Fatal(err)
	}
	imagesDir := t.TempDir()
	cli := NewAgent(Services(client), Config{ImagesDir: imagesDir, StateFile: path})

	done := make(chan error, 1)
	// The running agent's turn: unpin starts while it holds the lock, and it saves meanwhile.
	err = statefile.WithLock(path, func() error {
		go func() { _, err := cli.UnpinManual(ctx, kept); done <- err }()
		time.Sleep(500 * time.Millisecond) // unpin has started: reading the file, or waiting to
		s.Retained["other.tar"] = &statefile.Archive{Refs: map[string]digest.Digest{other: digest.FromString(other)}}
		data, err := json.Marshal(s) // as the holder of the lock writes it
		if err != nil {
			return err
		}
		return os.WriteFile(path, data, 0o600)
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("unpin did not return 30 s after the lock was released")
	}
	final, err := statefile.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if final.Retained["kept.tar"] != nil {
		t.Errorf("kept.tar still retained after unpin %s: %+v", kept, final.Retained["kept.tar"])
	}
	if final.Retained["other.tar"] == nil {
		t.Errorf("other.tar, retained by the other writer while unpin ran, is gone from the state file: unpin wrote back what it read before that save")
	}
	if img, err := client.ImageService().Get(ctx, kept); err != nil || img.Labels[pinning.LabelPinned] != "" {
		t.Errorf("%s after unpin: labels %v, %v", kept, img.Labels, err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}
}
