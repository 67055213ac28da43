package pinning

import (
	"errors"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

const d1 = digest.Digest("sha256:1111111111111111111111111111111111111111111111111111111111111111")

func img(name string, target digest.Digest, labels map[string]string) images.Image {
	return images.Image{Name: name, Target: ocispec.Descriptor{Digest: target}, Labels: labels}
}

func TestPolicyWants(t *testing.T) {
	p, err := NewPolicy(
		[]string{"nginx:1.27", "registry.local/team/app", "quay.io/x/y@" + string(d1), "registry.local/infra/*", "busy*"},
		[]string{"example.com/keep", "tier=system"},
	)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		img  images.Image
		want bool
	}{
		{img("docker.io/library/nginx:1.27", "", nil), true},        // exact, normalized
		{img("docker.io/library/nginx:1.28", "", nil), false},       // other tag
		{img("registry.local/team/app:7", "", nil), true},           // bare repo: any tag
		{img("registry.local/team/app@"+string(d1), "", nil), true}, // bare repo: digest ref
		{img("registry.local/team/application:7", "", nil), false},  // not a prefix match
		{img("quay.io/x/y:v1", d1, nil), true},                      // tag whose target is the digest
		{img("quay.io/x/y@"+string(d1), d1, nil), true},             // the digest ref itself
		{img("quay.io/x/y:v2", "sha256:22", nil), false},            // other content
		{img("registry.local/infra/dns:1", "", nil), true},          // glob on full name
		{img("docker.io/library/busybox:1.36", "", nil), true},      // glob on familiar name
		{img("other.example/z:1", "", map[string]string{"example.com/keep": ""}), true},
		{img("other.example/z:1", "", map[string]string{"tier": "system"}), true},
		{img("other.example/z:1", "", map[string]string{"tier": "user"}), false},
		{img("sha256:"+strings.Repeat("a", 64), "", nil), false}, // CRI id record
	} {
		if got := p.Wants(c.img); got != c.want {
			t.Errorf("Wants(%s %v) = %t, want %t", c.img.Name, c.img.Labels, got, c.want)
		}
	}
	var none *Policy
	if none.Wants(img("docker.io/library/nginx:1.27", "", nil)) || !none.Empty() {
		t.Error("nil policy wants something")
	}
}

func TestPolicyRejectsMalformedPatterns(t *testing.T) {
	for _, c := range []struct{ patterns, labels []string }{
		{patterns: []string{"bad[glob"}},
		{patterns: []string{"Nginx:1"}}, // repository names are lower case
		{patterns: []string{""}},
		{patterns: []string{"nginx@sha256:short"}},
		{labels: []string{"=value"}},
		{labels: []string{"a key"}},
	} {
		_, err := NewPolicy(c.patterns, c.labels)
		if err == nil {
			t.Errorf("NewPolicy(%q, %q) accepted", c.patterns, c.labels)
			continue
		}
		bad := append(c.patterns, c.labels...)[0]
		var pe *PolicyError
		if !errors.As(err, &pe) || pe.Value != bad || pe.Label != (len(c.labels) > 0) || !strings.Contains(err.Error(), "\""+bad+"\"") {
			t.Errorf("error %q (%#v) does not name the value %q and its kind", err, pe, bad)
		}
	}
}

func TestMisspelledPin(t *testing.T) {
	for labels, want := range map[string]bool{
		"io.cri.containerd.pinned=pinned": true,
		"io.cri-containerd.pinned=true":   true,
		"IO.CRI-CONTAINERD.PINNED=pinned": true,
		"io.cri-containerd.pinned=pinned": false,
		"io.cattle.k3s.pinned=pinned":     false,
	} {
		k, v, _ := strings.Cut(labels, "=")
		got := MisspelledPin(map[string]string{k: v}) != ""
		if got != want {
			t.Errorf("MisspelledPin(%s) = %t, want %t", labels, got, want)
		}
	}
}
