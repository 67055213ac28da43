package images_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
)

// fuzzEndings are the endings the fuzzer's bytes are read as.
var fuzzEndings = []string{".tar", ".tar.gz", ".tar.zst", ".txt"}

// FuzzReadIndex: whatever bytes a file of the images dir holds, ReadIndex returns an index whose
// every image has a reference, or an error naming the file; it never panics or hangs.
func FuzzReadIndex(f *testing.F) {
	dir := f.TempDir()
	img, err := imagetest.Image(1<<10, imagetest.Amd64)
	if err != nil {
		f.Fatal(err)
	}
	seeds := map[string]func(string) error{
		"docker.tar": func(p string) error {
			return imagetest.WriteDocker(p, map[string]v1.Image{"fuzz.example/app-a:1": img})
		},
		"oci.tar": func(p string) error { return imagetest.WriteOCI(p, map[string]any{"fuzz.example/app-b:1": img}) },
		"docker.tar.gz": func(p string) error {
			return imagetest.WriteDocker(p, map[string]v1.Image{"fuzz.example/app-c:1": img})
		},
	}
	for name, write := range seeds {
		path := filepath.Join(dir, name)
		if err := write(path); err != nil {
			f.Fatal(err)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		ending := uint8(0)
		if strings.HasSuffix(name, ".gz") {
			ending = 1
		}
		f.Add(data, ending)
		f.Add(data[:len(data)/2], ending)
	}
	f.Add([]byte("fuzz.example/app-d:1\n# comment\n\nnot a reference!!\n"), uint8(3))
	f.Fuzz(func(t *testing.T, data []byte, ending uint8) {
		path := filepath.Join(t.TempDir(), "fuzz"+fuzzEndings[int(ending)%len(fuzzEndings)])
		err := os.WriteFile(path, data, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		type result struct {
			idx *images.Index
			err error
		}
		done := make(chan result, 1)
		go func() {
			idx, err := images.ReadIndex(archiveAt(t, path))
			done <- result{idx, err}
		}()
		var idx *images.Index
		select {
		case r := <-done:
			idx, err = r.idx, r.err
		case <-time.After(5 * time.Second):
			t.Fatalf("ReadIndex of %d bytes as %s did not return within 5 s", len(data), filepath.Base(path))
		}
		if err != nil {
			if !strings.Contains(err.Error(), path) {
				t.Errorf("error does not name the file: %v", err)
			}
			return
		}
		for _, img := range idx.Images {
			if img.Ref == "" {
				t.Errorf("image without a reference in %+v", idx.Images)
			}
		}
	})
}
