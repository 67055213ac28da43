package images

import (
	"maps"
	"slices"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/distribution/reference"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// wantedSet is the keep-decision: a reference is wanted when an archive of the images dir
// provides it, when the policy names it, or when it was pinned by hand with `k3s-pinning pin`.
type wantedSet struct {
	refs     map[string]string // reference -> archive file name
	archives map[string]bool   // archive file names present in the images dir
	policy   *pinning.Policy
}

func newWantedSet(indexes []*Index, state *State, policy *pinning.Policy, extraRegistries []string) *wantedSet {
	w := &wantedSet{refs: map[string]string{}, archives: map[string]bool{}, policy: policy}
	// What the archives provided when last loaded (digest references of docker archives are known
	// only after import), as long as the archive is still in the images dir.
	for _, idx := range indexes {
		w.archives[idx.Archive.Name()] = true
	}
	for _, name := range slices.Sorted(maps.Keys(state.Archives)) {
		if w.archives[name] {
			for ref := range state.Archives[name].Refs {
				if _, taken := w.refs[ref]; !taken {
					w.refs[ref] = name
				}
			}
		}
	}
	for _, idx := range indexes {
		for _, img := range idx.Images {
			for _, r := range References(img.Ref, img.Digest, extraRegistries) {
				if _, taken := w.refs[r]; !taken { // archives are read in name order: the first wins
					w.refs[r] = idx.Archive.Name()
				}
			}
		}
	}
	return w
}

// source says what wants img kept.
func (w *wantedSet) source(img images.Image) (string, bool) {
	if src, ok := w.refs[img.Name]; ok {
		return src, true
	}
	if src, ours := pinning.OwnPin(img.Labels); ours && (src == pinning.SourceManual || w.archives[src]) {
		// a digest reference or retag of a docker archive, whose digest is known only after import
		return src, true
	}
	if w.policy.Wants(img) {
		return pinning.SourcePolicy, true
	}
	return "", false
}

func normalize(ref string) string {
	named, err := reference.ParseDockerRef(ref)
	if err != nil {
		return ref
	}
	return named.String()
}
