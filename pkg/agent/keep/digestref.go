package keep

import (
	"fmt"
	"strings"
	"sync"

	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
)

// DigestRefs remembers the repo@digest form of references (Of), as k3s names an imported image
// and the CRI lists it among an image's RepoDigests. Every sync and every keep-set asks it of
// every wanted reference: the agent keeps one memo, which the plan, the keep-set and the importer
// share (one string per name), and forgets it when a sync or restore ends (a daemon between syncs
// does not hold it). Safe for concurrent use: archives load in parallel.
type DigestRefs struct {
	mu sync.Mutex
	m  map[digestRefKey]string
}

type digestRefKey struct {
	ref string
	d   digest.Digest
}

// maxDigestRefs bounds the memo at ten times the references of a large node.
const maxDigestRefs = 100_000

// NewDigestRefs is an empty memo.
func NewDigestRefs() *DigestRefs { return &DigestRefs{m: map[digestRefKey]string{}} }

// Of is the repo@digest form of ref; "" when ref is not a reference or d is unknown.
func (r *DigestRefs) Of(ref string, d digest.Digest) string {
	key := digestRefKey{ref, d}
	r.mu.Lock()
	dr, ok := r.m[key]
	r.mu.Unlock()
	if ok {
		return dr
	}
	dr = parseDigestRef(ref, d)
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.m) >= maxDigestRefs {
		clear(r.m) // a node's references change slowly: start again rather than track use
	}
	r.m[key] = dr
	return dr
}

// Forget drops what the memo holds.
func (r *DigestRefs) Forget() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.m = map[digestRefKey]string{}
}

// parseDigestRef is digestRef's answer, not remembered.
func parseDigestRef(ref string, d digest.Digest) string {
	if dr, ok := quickDigestRef(ref, d); ok {
		return dr
	}
	return grammarDigestRef(ref, d)
}

// grammarDigestRef is digestRef's answer from the reference grammar. Its regular expressions are
// slow for what a warm restart asks of every wanted name and every name the store lists:
// quickDigestRef answers the usual form first.
func grammarDigestRef(ref string, d digest.Digest) string {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil || d == "" {
		return ""
	}
	c, err := reference.WithDigest(reference.TrimNamed(named), d)
	if err != nil {
		return ""
	}
	return c.String()
}

// quickDigestRef is grammarDigestRef's answer for a name in the form containerd keeps images by
// and the state records (domain/path[:tag][@sha256:...]: the domain written out, lowercase, a
// sha256 digest), read from its bytes. ok is false for every other form (a familiar name like
// nginx:1 that the grammar completes, docker.io with one path component, index.docker.io, an
// IPv6 host, uppercase, another digest algorithm, anything the grammar refuses): those are the
// grammar's to answer. What it accepts is a subset of what the grammar accepts, where the name
// is the reference's bytes up to its tag, so the answers are the same (FuzzQuickDigestRef).
func quickDigestRef(ref string, d digest.Digest) (string, bool) {
	if !isSHA256(string(d)) {
		return "", false
	}
	name, dig, digested := strings.Cut(ref, "@")
	if digested && !isSHA256(dig) {
		return "", false
	}
	domain, path, ok := strings.Cut(name, "/")
	if !ok || domain == "index.docker.io" || !(domain == "localhost" || strings.ContainsAny(domain, ".:")) {
		return "", false
	}
	if i := strings.IndexByte(path, ':'); i >= 0 {
		if !isTag(path[i+1:]) {
			return "", false
		}
		path = path[:i]
	}
	if domain == "docker.io" && !strings.Contains(path, "/") {
		return "", false // the grammar puts it under library/
	}
	if len(path) > reference.RepositoryNameTotalLengthMax || !isDomain(domain) || !isPath(path) {
		return "", false
	}
	return name[:len(domain)+1+len(path)] + "@" + string(d), true
}

// isSHA256 is s as a sha256 digest with lowercase hex.
func isSHA256(s string) bool {
	hex, ok := strings.CutPrefix(s, "sha256:")
	if !ok || len(hex) != 64 {
		return false
	}
	for i := range len(hex) {
		if !isDigit(hex[i]) && (hex[i] < 'a' || hex[i] > 'f') {
			return false
		}
	}
	return true
}

// isTag is the grammar's tag: [\w][\w.-]{0,127}.
func isTag(t string) bool {
	if t == "" || len(t) > 128 || t[0] == '.' || t[0] == '-' {
		return false
	}
	for i := range len(t) {
		c := t[i]
		if !isLowerAlnum(c) && !(c >= 'A' && c <= 'Z') && c != '_' && c != '.' && c != '-' {
			return false
		}
	}
	return true
}

// isDomain is a lowercase host name or IPv4 address, with an optional port: stricter than the
// grammar (which also takes uppercase and IPv6 hosts), never looser.
func isDomain(domain string) bool {
	host, port, hasPort := strings.Cut(domain, ":")
	if hasPort {
		if port == "" {
			return false
		}
		for i := range len(port) {
			if !isDigit(port[i]) {
				return false
			}
		}
	}
	for component := range strings.SplitSeq(host, ".") {
		if component == "" || component[0] == '-' || component[len(component)-1] == '-' {
			return false
		}
		for i := range len(component) {
			if !isLowerAlnum(component[i]) && component[i] != '-' {
				return false
			}
		}
	}
	return true
}

// isPath is the grammar's repository path: components of [a-z0-9]+ joined by one separator
// ("." or "_" or "__" or a run of "-"), separated by "/".
func isPath(path string) bool {
	for component := range strings.SplitSeq(path, "/") {
		for i := 0; ; {
			j := i
			for j < len(component) && isLowerAlnum(component[j]) {
				j++
			}
			if j == i {
				return false // empty, or a separator not after an alphanumeric
			}
			if j == len(component) {
				break
			}
			k := j
			for k < len(component) && !isLowerAlnum(component[k]) {
				k++
			}
			if sep := component[j:k]; k == len(component) || !(sep == "." || sep == "_" || sep == "__" || strings.Trim(sep, "-") == "") {
				return false
			}
			i = k
		}
	}
	return true
}

func isDigit(c byte) bool      { return c >= '0' && c <= '9' }
func isLowerAlnum(c byte) bool { return isDigit(c) || (c >= 'a' && c <= 'z') }

// References are all the names one image of an archive gets, as k3s names what it imports: its
// own, repo@digest (once the digest is known), and per --airgap-extra-registry the tag and the
// digest under that registry; a registry that already hosts the image (the name starts with it)
// adds nothing, so that a registry with a path is not repeated.
func (r *DigestRefs) References(name string, dgst digest.Digest, extraRegistries []string) []string {
	names := []string{name}
	if dr := r.Of(name, dgst); dr != "" {
		names = append(names, dr)
	}
	if len(extraRegistries) == 0 {
		return names // the usual case, without parsing name again
	}
	tagged, err := reference.ParseDockerRef(name)
	if err != nil {
		return names
	}
	t, ok := tagged.(reference.NamedTagged)
	if !ok {
		return names
	}
	seen := map[string]bool{}
	for _, reg := range extraRegistries {
		reg = strings.TrimSuffix(reg, "/")
		if reg == "" || seen[reg] || strings.HasPrefix(t.Name(), reg+"/") {
			continue
		}
		seen[reg] = true
		names = append(names, fmt.Sprintf("%s/%s:%s", reg, reference.Path(t), t.Tag()))
		if dgst != "" {
			names = append(names, fmt.Sprintf("%s/%s@%s", reg, reference.Path(t), dgst))
		}
	}
	return names
}
