package keep

import (
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
)

// The names a node's store and state hold (every name containerd's import and the CRI give an
// image, written out in full) and names the grammar must read.
var (
	quickNames = []string{
		"docker.io/library/nginx:1.25",
		"docker.io/rancher/mirrored-pause:3.6",
		"registry.k8s.io/pause:3.10",
		"localhost:5000/a/b:1",
		"localhost/x",
		"127.0.0.1:5000/x",
		"bench.example/s/a0001-img1:1.0",
		"quay.io/a__b/c.d-e---f_g:V1.0_rc-1",
		"docker.io/library/nginx@sha256:" + strings.Repeat("ab", 32),
		"ghcr.io/x/y:t@sha256:" + strings.Repeat("0f", 32),
		"a-b.c/d:" + strings.Repeat("t", 128),
	}
	grammarNames = []string{
		"nginx:1", "nginx", "rancher/pause:3.6", // familiar: the grammar writes docker.io out
		"docker.io/nginx:1",               // under library/
		"index.docker.io/library/nginx:1", // the legacy index is docker.io
		"Example.com/x:1",                 // an uppercase domain: valid, but the grammar's
		"[::1]:5000/x:1",                  // an IPv6 host: the grammar's
		"example.com/X:1", "example.com/x:-1", "example.com/x..y:1", "example.com/x._y",
		"example.com/x-:1", "example.com//x", "example.com/x:", "example.com:/x", "example.com/x:1:2",
		"-a.com/x", "a.com/x:" + strings.Repeat("t", 129), "a.com/" + strings.Repeat("x", 256),
		"example.com/x@sha512:" + strings.Repeat("ab", 64),
		"example.com/x@sha256:" + strings.Repeat("AB", 32),
		"example.com/x@sha256:abc", "sha256:" + strings.Repeat("ab", 32), "",
	}
)

// TestQuickDigestRef: the names containerd holds are read without the grammar, to the grammar's
// answer; every other form is left to the grammar, and so is every digest but a lowercase
// sha256 one. Without the quick reading a warm restart parses every wanted name and every name
// the store lists with regular expressions.
func TestQuickDigestRef(t *testing.T) {
	d := testDigest("image")
	for _, ref := range quickNames {
		dr, ok := quickDigestRef(ref, d)
		if want := grammarDigestRef(ref, d); !ok || dr != want || want == "" {
			t.Errorf("quickDigestRef(%q) = %q, %v; want %q (the grammar's), true", ref, dr, ok, want)
		}
		if dr := NewDigestRefs().Of(ref, d); !strings.HasSuffix(dr, "@"+d.String()) {
			t.Errorf("NewDigestRefs().Of(%q) = %q", ref, dr)
		}
	}
	for _, ref := range grammarNames {
		if dr, ok := quickDigestRef(ref, d); ok {
			t.Errorf("quickDigestRef(%q) = %q, true; the grammar answers for it (%q)", ref, dr, grammarDigestRef(ref, d))
		}
	}
	for _, d := range []digest.Digest{"", "sha256:abc", digest.SHA512.FromString("image"), digest.Digest("sha256:" + strings.Repeat("AB", 32))} {
		if dr, ok := quickDigestRef("docker.io/library/nginx:1", d); ok {
			t.Errorf("quickDigestRef with digest %q = %q, true", d, dr)
		}
	}
	if got, want := NewDigestRefs().Of("nginx:1", d), "docker.io/library/nginx@"+d.String(); got != want {
		t.Errorf("NewDigestRefs().Of(nginx:1) = %q, want %q", got, want)
	}
}

// FuzzQuickDigestRef: wherever quickDigestRef answers, the grammar answers the same.
func FuzzQuickDigestRef(f *testing.F) {
	for _, ref := range append(quickNames, grammarNames...) {
		f.Add(ref, true, "image")
		f.Add(ref, false, "sha256:"+strings.Repeat("ab", 32))
	}
	f.Fuzz(func(t *testing.T, ref string, hashed bool, d string) {
		dig := digest.Digest(d)
		if hashed {
			dig = digest.FromString(d)
		}
		if dr, ok := quickDigestRef(ref, dig); ok {
			if want := grammarDigestRef(ref, dig); dr != want {
				t.Fatalf("quickDigestRef(%q, %q) = %q; the grammar says %q", ref, dig, dr, want)
			}
		}
	})
}
