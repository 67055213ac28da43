package images

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// wantedSet is the keep-decision: a reference is wanted when an archive of the images dir
// provides it, when the policy names it, or when it was pinned by hand with `k3s-pinning pin`.
type wantedSet struct {
	refs     map[string]string // reference -> archive file name
	archives map[string]bool   // archive file names present in the images dir
	policy   *pinning.Policy
}

// newWantedSet is the keep-decision for the archives present in the images dir (present), of
// which indexes could be read. An archive that cannot be read now still wants what it provided
// when it last loaded: a damaged file never drops protection.
func newWantedSet(present []string, indexes []*Index, state *State, policy *pinning.Policy, extraRegistries []string) *wantedSet {
	w := &wantedSet{refs: map[string]string{}, archives: map[string]bool{}, policy: policy}
	for _, name := range present {
		w.archives[name] = true
	}
	// What the archives provided when last loaded (digest references of docker archives are known
	// only after import), as long as the archive is still in the images dir.
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

// Keeper is the keep-decision as the kubelet's image garbage collector asks it, image by image,
// from its own goroutines: the agent publishes a new keepSet after every reconcile, and Keep reads
// the current one without a lock.
type Keeper struct {
	set    atomic.Pointer[keepSet]
	policy *pinning.Policy
}

// keepSet is what the agent wanted at its last reconcile, in the forms the CRI lists an image by.
type keepSet struct {
	names map[string]bool // references (repo:tag, repo@digest) as containerd names them
	ids   map[string]bool // CRI image IDs (config digests) of wanted images present in containerd
	// byPolicy memoizes the policy's answer per name: parsing a reference costs microseconds, and
	// the kubelet asks about the same names every cycle. It starts empty with each set, so it holds
	// only names seen since the last reconcile.
	byPolicy sync.Map // name -> bool
}

// Keep reports whether the image the CRI lists with image ID id, repoTags and repoDigests must
// stay on the node: one of its names was wanted at the agent's last reconcile, its ID is that of
// a wanted image, or the --pinned-images patterns name it. Label selectors
// (--pinned-image-labels) are answered from the last reconcile: the CRI does not list labels.
func (k *Keeper) Keep(id string, repoTags, repoDigests []string) bool {
	set := k.set.Load()
	if set.ids[id] {
		return true
	}
	for _, names := range [][]string{repoTags, repoDigests} {
		for _, name := range names {
			if set.names[name] {
				return true
			}
		}
	}
	if k.policy.Empty() {
		return false
	}
	for _, names := range [][]string{repoTags, repoDigests} {
		for _, name := range names {
			wanted, known := set.byPolicy.Load(name)
			if !known {
				wanted = k.policy.Wants(images.Image{Name: name})
				set.byPolicy.Store(name, wanted)
			}
			if wanted.(bool) {
				return true
			}
		}
	}
	return false
}

// publish makes w, resolved against the images containerd holds (all), the answer of Keep.
func (k *Keeper) publish(w *wantedSet, all []images.Image) {
	set := &keepSet{names: map[string]bool{}, ids: map[string]bool{}}
	for ref := range w.refs {
		set.names[ref] = true
	}
	targets := map[digest.Digest]bool{}
	for _, img := range all {
		if isImageIDRecord(img.Name) {
			continue
		}
		if _, wanted := w.source(img); wanted {
			set.names[img.Name] = true
			set.names[digestName(img.Name, img.Target.Digest)] = true
			targets[img.Target.Digest] = true
		}
	}
	// The CRI keeps a sha256:<image ID> record beside each image, on the same target: it is the
	// image's ID, and the kubelet lists an image by it alone once every tag is gone.
	for _, img := range all {
		if isImageIDRecord(img.Name) && targets[img.Target.Digest] {
			set.ids[img.Name] = true
		}
	}
	k.set.Store(set)
}

// publishRecorded is the answer before the first reconcile: every reference the state recorded,
// whether or not its archive is still there, so that a kubelet starting beside the agent never
// sees a gap.
func (k *Keeper) publishRecorded(state *State) {
	set := &keepSet{names: map[string]bool{}, ids: map[string]bool{}}
	for _, rec := range state.Archives {
		for ref, d := range rec.Refs {
			set.names[ref] = true
			set.names[digestName(ref, d)] = true
		}
	}
	k.set.Store(set)
}

// digestName is the repo@digest form of ref, as the CRI lists it among an image's RepoDigests.
func digestName(ref string, d digest.Digest) string {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil || d == "" {
		return ref
	}
	return named.Name() + "@" + d.String()
}

func normalize(ref string) string {
	named, err := reference.ParseDockerRef(ref)
	if err != nil {
		return ref
	}
	return named.String()
}
