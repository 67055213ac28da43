package pinning

import (
	"errors"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/distribution/reference"
)

// FuzzPolicy: any --pinned-images or --pinned-image-labels value is accepted or refused with a
// PolicyError naming the value and its kind (the caller adds the flag); an accepted exact reference wants an image of that name; Wants never
// panics on any name.
func FuzzPolicy(f *testing.F) {
	for _, s := range []string{"nginx", "docker.io/library/nginx:1.27", "registry.local/*", "nginx@" + string(d1),
		"[", "key=value", "example.com/keep", "", " ", "a/b/c:d", "*", "sha256:" + strings.Repeat("a", 64)} {
		f.Add(s, "docker.io/library/nginx:1.27")
	}
	f.Fuzz(func(t *testing.T, value, name string) {
		p, err := NewPolicy([]string{value}, nil)
		if err != nil {
			if pe := (*PolicyError)(nil); !errors.As(err, &pe) || pe.Value != value || pe.Label {
				t.Errorf("error is not the pattern's PolicyError: %v", err)
			}
		} else {
			p.Wants(images.Image{Name: name})
			if named, err := reference.ParseNormalizedNamed(strings.TrimSpace(value)); err == nil && !strings.ContainsAny(value, "*?[") {
				if tagged, ok := named.(reference.NamedTagged); ok && !p.Wants(images.Image{Name: tagged.String()}) {
					t.Errorf("policy %q does not want %s", value, tagged.String())
				}
			}
		}
		if _, err := NewPolicy(nil, []string{value}); err != nil {
			if pe := (*PolicyError)(nil); !errors.As(err, &pe) || pe.Value != value || !pe.Label {
				t.Errorf("error is not the selector's PolicyError: %v", err)
			}
		}
	})
}
