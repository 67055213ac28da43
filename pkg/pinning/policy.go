package pinning

import (
	"fmt"
	"path"
	"strings"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
)

// Policy says which images must be kept beyond those the images dir provides: the images a user
// imported by hand and named with --pinned-images or labelled for --pinned-image-labels.
// The zero Policy wants nothing.
type Policy struct {
	patterns []pattern
	labels   []labelSelector
}

// PolicyError is a pattern or selector NewPolicy cannot parse. The caller knows the flag, the
// variable or the config key the value came from, and names it.
type PolicyError struct {
	Value string
	Label bool // a label selector, not an image pattern
	Err   error
}

func (e *PolicyError) Error() string {
	kind := "image pattern"
	if e.Label {
		kind = "label selector"
	}
	return fmt.Sprintf("%s %q: %v", kind, e.Value, e.Err)
}

func (e *PolicyError) Unwrap() error { return e.Err }

// NewPolicy parses image patterns (--pinned-images) and label selectors (--pinned-image-labels).
//
// A pattern is an exact reference (repo:tag or repo@digest), a bare repository (every tag and
// digest of it), or a glob with * ? [ ] matched against both the full and the short form of a name
// (docker.io/library/nginx:1.27 and nginx:1.27). A selector is key or key=value.
//
// A pattern value may hold several patterns separated by commas: k3s reads a list flag's K3S_
// variable as one value (it disables urfave/cli's splitting), and no image name has a comma.
func NewPolicy(patterns, labelSelectors []string) (*Policy, error) {
	p := &Policy{}
	for _, value := range patterns {
		parts := strings.Split(value, ",")
		for _, s := range parts {
			pat, err := parsePattern(s)
			if err != nil {
				if len(parts) > 1 {
					err = fmt.Errorf("%q: %w", s, err) // the value stays what the user gave
				}
				return nil, &PolicyError{Value: value, Err: err}
			}
			p.patterns = append(p.patterns, pat)
		}
	}
	for _, s := range labelSelectors {
		sel, err := parseLabelSelector(s)
		if err != nil {
			return nil, &PolicyError{Value: s, Label: true, Err: err}
		}
		p.labels = append(p.labels, sel)
	}
	return p, nil
}

// Empty reports whether the policy wants nothing.
func (p *Policy) Empty() bool { return p == nil || len(p.patterns)+len(p.labels) == 0 }

// Wants reports whether the policy wants img kept: its name matches a pattern, its target is a
// digest a pattern names, or its labels match a selector.
func (p *Policy) Wants(img images.Image) bool {
	if p == nil {
		return false
	}
	for _, sel := range p.labels {
		if v, ok := img.Labels[sel.key]; ok && (!sel.hasValue || v == sel.value) {
			return true
		}
	}
	if len(p.patterns) == 0 {
		return false
	}
	named, err := reference.ParseNormalizedNamed(img.Name)
	if err != nil {
		return false // sha256:<id> records and other names that are not references
	}
	for _, pat := range p.patterns {
		if pat.match(named, img.Target.Digest) {
			return true
		}
	}
	return false
}

// Digests are the references the policy names by digest (repo@sha256:...), normalized as
// containerd names images: the only ones the policy can name an image by without a guess, so the
// only ones an agent may fetch for it (a tag may point elsewhere by now).
func (p *Policy) Digests() []string {
	if p == nil {
		return nil
	}
	var refs []string
	for _, pat := range p.patterns {
		if pat.kind == byDigest {
			refs = append(refs, pat.text+"@"+pat.digest.String())
		}
	}
	return refs
}

type patternKind int

const (
	exactRef patternKind = iota
	bareRepo
	byDigest
	glob
)

type pattern struct {
	kind   patternKind
	text   string // exactRef: normalized reference; bareRepo, byDigest: repository name; glob: the glob
	digest digest.Digest
}

func parsePattern(s string) (pattern, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return pattern{}, fmt.Errorf("empty pattern")
	}
	if strings.ContainsAny(s, "*?[") {
		if _, err := path.Match(s, ""); err != nil {
			return pattern{}, fmt.Errorf("bad glob: %w", err)
		}
		return pattern{kind: glob, text: s}, nil
	}
	named, err := reference.ParseNormalizedNamed(s)
	if err != nil {
		return pattern{}, fmt.Errorf("not an image reference: %w", err)
	}
	switch r := named.(type) {
	case reference.Canonical:
		return pattern{kind: byDigest, text: r.Name(), digest: r.Digest()}, nil
	case reference.NamedTagged:
		return pattern{kind: exactRef, text: r.String()}, nil
	default:
		return pattern{kind: bareRepo, text: named.Name()}, nil
	}
}

func (p pattern) match(named reference.Named, target digest.Digest) bool {
	switch p.kind {
	case exactRef:
		return named.String() == p.text
	case bareRepo:
		return named.Name() == p.text
	case byDigest:
		if named.Name() != p.text {
			return false
		}
		if c, ok := named.(reference.Canonical); ok && c.Digest() == p.digest {
			return true
		}
		return target == p.digest
	default:
		for _, s := range []string{named.String(), reference.FamiliarString(named)} {
			if ok, _ := path.Match(p.text, s); ok {
				return true
			}
		}
		return false
	}
}

type labelSelector struct {
	key, value string
	hasValue   bool
}

func parseLabelSelector(s string) (labelSelector, error) {
	key, value, hasValue := strings.Cut(strings.TrimSpace(s), "=")
	if key == "" {
		return labelSelector{}, fmt.Errorf("empty label key")
	}
	if strings.ContainsAny(key, " \t\n,") {
		return labelSelector{}, fmt.Errorf("label key %q has a space or comma", key)
	}
	return labelSelector{key: key, value: value, hasValue: hasValue}, nil
}
