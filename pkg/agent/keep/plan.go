// Package keep is the keep-decision, the one place it is made: which references must stay on
// the node and what wants each (Plan), and the kubelet image GC filter's answer made from it
// (Keeper). It is a pure function of plain values: what the images dir holds (airgap indexes),
// what the state file recorded (statefile), the policy and the workloads; an image containerd
// lists enters only as the question. It talks to nothing (internal/depcheck keeps it so).
// DigestRefs names references as k3s names an imported image (repo@digest), for the plan and the
// importer alike.
package keep

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Plan is the keep-decision, the one place it is made: which references must stay on the node
// and what wants each. A reference is wanted when an archive of the images dir provides it (the
// first by file name wins), when the policy names it, or when it was pinned by hand with
// `k3s-pinning pin`. Sync, Inspect, re-pin, release, the adoption of k3s's pins and the kubelet's
// Keeper all ask it. It is computed from plain values, without containerd: what the images dir
// holds, what the state recorded, and the policy; an image containerd lists enters as the
// question (Source).
type Plan struct {
	refs     map[string]string        // reference -> archive that provides it
	digests  map[string]digest.Digest // reference -> what it points at, where known
	archives map[string]bool          // archives in the images dir
	// recorded are the archives in the images dir whose load the state records: what such an
	// archive provides is known in full (refs), so a pin it set on anything else is stale.
	recorded map[string]bool
	policy   *pinning.Policy
	owners   *owners // which archive loads each reference, and the claims it overrules
	// workloads are the references the cluster's workloads name (--pinned-workload-images), as
	// containerd names images; nil while they are not known (the flag is off, or the API server
	// has not answered): then a pin set for a workload is kept as it is, never released on a
	// guess.
	workloads map[string]bool
	// retained are archives removed from the images dir whose references stay wanted
	// (--retain-removed-archive-images): they provide like an archive, but nothing restores
	// from them; a deleted one is fetched.
	retained map[string]bool
	// fetchable are the wanted references that can be fetched by a digest known for them: those
	// the policy names by digest, a retained archive's, a workload's named by digest.
	fetchable map[string]digest.Digest
	// digestRefs answers the repo@digest names of the plan and of the keep-set made from it.
	digestRefs *DigestRefs
}

// Input is what a plan is made of.
type Input struct {
	// Present are the archives in the images dir, by file name; when the dir cannot be read,
	// every recorded archive (nothing left it).
	Present []string
	// Read are the indexes read from present archives this time; an archive missing here (it
	// cannot be read now) claims what it recorded: a damaged file never drops protection.
	Read            map[string]*airgap.Index
	Recorded        map[string]*statefile.Archive
	Policy          *pinning.Policy
	ExtraRegistries []string
	Workloads       map[string]bool
	// Retained are the records of archives removed from the images dir that are kept.
	Retained map[string]*statefile.Archive
	// DigestRefs is the agent's memo of repo@digest names; nil: the plan makes its own.
	DigestRefs *DigestRefs
}

// newPlan decides, archive by archive in file-name order, what each provides: the names its
// index gives each image (References) and what its last load recorded (digest references of
// docker archives are known only after import). The first archive to provide a reference is its
// source, the same rule by which ownership decides which archive loads it.
func New(in Input) *Plan {
	p := &Plan{refs: map[string]string{}, digests: map[string]digest.Digest{}, archives: map[string]bool{}, recorded: map[string]bool{}, policy: in.Policy, workloads: in.Workloads,
		retained: map[string]bool{}, fetchable: map[string]digest.Digest{}, digestRefs: in.DigestRefs}
	if p.digestRefs == nil {
		p.digestRefs = NewDigestRefs()
	}
	names := slices.Sorted(slices.Values(in.Present))
	claims := map[string]*airgap.Index{}
	var ordered []*airgap.Index
	for _, name := range names {
		p.archives[name] = true
		p.recorded[name] = in.Recorded[name] != nil
		idx := in.Read[name]
		if rec := in.Recorded[name]; idx == nil && rec != nil {
			idx = rec.Index(airgap.Archive{Path: name}) // only its name is asked for
		}
		if idx != nil {
			claims[name] = idx
			ordered = append(ordered, idx)
		}
	}
	p.owners = ownership(ordered)
	for _, name := range names {
		if idx := claims[name]; idx != nil {
			// A claim another archive overrules is not this archive's to provide.
			for _, img := range p.owners.loadable(idx).Images {
				for _, r := range p.digestRefs.References(img.Ref, img.Digest, in.ExtraRegistries) {
					p.provide(r, name, img.Digest)
				}
			}
		}
		if rec := in.Recorded[name]; rec != nil {
			for _, r := range slices.Sorted(maps.Keys(rec.Refs)) {
				p.provide(r, name, rec.Refs[r])
			}
		}
	}
	// A retained archive provides after every archive present: one back in the dir, or another
	// providing the same reference, comes first.
	for _, name := range slices.Sorted(maps.Keys(in.Retained)) {
		if p.archives[name] {
			continue
		}
		p.retained[name] = true
		rec := in.Retained[name]
		for _, r := range slices.Sorted(maps.Keys(rec.Refs)) {
			p.provide(r, name, rec.Refs[r])
			if p.refs[r] == name && rec.Refs[r] != "" {
				p.fetchable[r] = rec.Refs[r]
			}
		}
	}
	for _, r := range in.Policy.Digests() {
		if d := refDigest(r); d != "" && !p.archives[p.refs[r]] {
			p.fetchable[r] = d
		}
	}
	for r := range in.Workloads {
		if d := refDigest(r); d != "" && !p.archives[p.refs[r]] {
			p.fetchable[r] = d
		}
	}
	return p
}

// refDigest is the digest ref names (repo@sha256:...), or "" for a tag.
func refDigest(ref string) digest.Digest {
	if named, err := reference.ParseNormalizedNamed(ref); err == nil {
		if c, ok := named.(reference.Canonical); ok {
			return c.Digest()
		}
	}
	return ""
}

func (p *Plan) provide(ref, archive string, d digest.Digest) {
	if _, taken := p.refs[ref]; !taken {
		p.refs[ref] = archive
	}
	if _, known := p.digests[ref]; !known && d != "" && p.refs[ref] == archive {
		p.digests[ref] = d
	}
}

// Source says what wants img kept: the archive that provides its name; the source our pin on it
// records, while that source may still want it (a manual pin; an archive in the dir whose load
// is not recorded yet, so what it provides is not known in full; a workload while the workloads
// are not known); the policy; or a workload of the cluster. An archive whose load is recorded
// wants exactly what it provides: a pin it set on anything else (a digest reference of its
// previous content whose release was lost to a restart, a lost state file) is not wanted.
func (p *Plan) Source(img images.Image) (string, bool) {
	if src, ok := p.refs[img.Name]; ok {
		return src, true
	}
	if src, ours := pinning.OwnPin(img.Labels); ours && (src == pinning.SourceManual || (p.archives[src] && !p.recorded[src]) || (src == pinning.SourceWorkload && p.workloads == nil)) {
		return src, true
	}
	if p.policy.Wants(img) {
		return pinning.SourcePolicy, true
	}
	if p.workloads[img.Name] {
		return pinning.SourceWorkload, true
	}
	return "", false
}

// Archive is the archive in the images dir that provides ref, or "": where a deleted reference is
// restored from (a retained archive is gone: its references are fetched).
func (p *Plan) Archive(ref string) string {
	if src := p.refs[ref]; p.archives[src] {
		return src
	}
	return ""
}

// Fetchable is the digest a missing ref can be fetched by, when it is wanted, no archive in the
// images dir provides it, and a digest is known for it; ok false otherwise.
func (p *Plan) Fetchable(ref string) (d digest.Digest, ok bool) {
	d, ok = p.fetchable[ref]
	return d, ok
}

// Retained reports whether source is an archive removed from the images dir whose references
// are kept.
func (p *Plan) Retained(source string) bool { return p.retained[source] }

// Heir is what wants img kept once source gives it up: Source without the pin source records.
func (p *Plan) Heir(img images.Image, source string) string {
	if src := p.refs[img.Name]; src != "" && src != source {
		return src
	}
	if p.policy.Wants(img) {
		return pinning.SourcePolicy
	}
	if p.workloads[img.Name] {
		return pinning.SourceWorkload
	}
	return ""
}

// Provided are the references the images dir provides, with the archive of each.
func (p *Plan) Provided() map[string]string { return p.refs }

// Conflicts are the references two archives provide with different images.
func (p *Plan) Conflicts() []Conflict { return p.owners.conflicts }

// Keeper is the keep-decision as the kubelet's image garbage collector asks it, image by image,
// from its own goroutines: a frozen snapshot of the agent's plan as of its last reconcile,
// replaced whole after each one, read without a lock.
type Keeper struct {
	set atomic.Pointer[keepSet]
}

// keepSet is a plan resolved against what containerd listed, in the forms the CRI lists an
// image by.
type keepSet struct {
	plan  *Plan
	names map[string]bool // references (repo:tag, repo@digest) as containerd names them
	ids   map[string]bool // CRI image IDs (config digests) of wanted images present in containerd
	// byName memoizes the plan's answer for names the kubelet asks about that are not in names
	// (the policy's patterns): parsing a reference costs microseconds, and the kubelet asks about
	// the same names every cycle. It starts empty with each set.
	byName sync.Map // name -> bool
}

// Keep reports whether the image the CRI lists with image ID id, repoTags and repoDigests must
// stay on the node: one of its names or its ID is wanted in the plan of the agent's last
// reconcile. Label selectors (--pinned-image-labels) are answered from that reconcile's list: the
// CRI does not list labels. Before any plan is published nothing is kept.
func (k *Keeper) Keep(id string, repoTags, repoDigests []string) bool {
	set := k.set.Load()
	if set == nil {
		return false
	}
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
	if set.plan.policy.Empty() && len(set.plan.workloads) == 0 {
		return false
	}
	for _, names := range [][]string{repoTags, repoDigests} {
		for _, name := range names {
			wanted, known := set.byName.Load(name)
			if !known {
				_, wanted = set.plan.Source(images.Image{Name: name})
				set.byName.Store(name, wanted)
			}
			if wanted.(bool) {
				return true
			}
		}
	}
	return false
}

// Wanted reports whether name is a reference the last published set keeps.
func (k *Keeper) Wanted(name string) bool {
	set := k.set.Load()
	return set != nil && set.names[name]
}

// Publish makes plan, resolved against the images containerd holds (listed; nil before the
// first list), the answer of Keep.
func (k *Keeper) Publish(plan *Plan, listed imagelist.Records) {
	set := &keepSet{plan: plan, names: map[string]bool{}, ids: map[string]bool{}}
	// A name already in the set is not stored again: storing an equal string key replaces the
	// key, and the set would then hold the list's copy of each name (decoded from containerd's
	// answer, garbage once the sync ends) beside the plan's own, for as long as the daemon rests.
	keep := func(name string) {
		if name != "" && !set.names[name] {
			set.names[name] = true
		}
	}
	for ref := range plan.refs {
		keep(ref)
		keep(plan.digestRefs.Of(ref, plan.digests[ref]))
	}
	targets := map[digest.Digest]bool{}
	for img := range listed.Images() {
		if imagelist.IsImageID(img.Name) {
			continue
		}
		if _, wanted := plan.Source(img); wanted {
			keep(img.Name)
			keep(plan.digestRefs.Of(img.Name, img.Target.Digest))
			targets[img.Target.Digest] = true
		}
	}
	// The CRI keeps a sha256:<image ID> record beside each image, on the same target: it is the
	// image's ID, and the kubelet lists an image by it alone once every tag is gone.
	for _, img := range listed {
		if imagelist.IsImageID(img.Name) && targets[img.Target.Digest] {
			set.ids[img.Name] = true
		}
	}
	k.set.Store(set)
}

// WantedBesidesWorkloads reports whether an archive or the policy wants ref, whatever the
// workloads say.
func (p *Plan) WantedBesidesWorkloads(ref string) bool {
	_, provided := p.refs[ref]
	return provided || p.policy.Wants(images.Image{Name: ref})
}

// Fetchables are the wanted references that can be fetched by a digest known for them (Fetchable),
// each with that digest: the plan's own map, to be read and never written.
func (p *Plan) Fetchables() map[string]digest.Digest { return p.fetchable }

// Loadable is idx without the claims another archive overrules: what its archive loads.
func (p *Plan) Loadable(idx *airgap.Index) *airgap.Index { return p.owners.loadable(idx) }

// Loader is the archive that loads ref ("": none).
func (p *Plan) Loader(ref string) string { return p.owners.of(ref) }

// Shadowed are the claims of archive that another archive overrules.
func (p *Plan) Shadowed(archive string) []Conflict { return p.owners.shadowed(archive) }

// Digest is what ref points at, where the plan knows it ("" otherwise).
func (p *Plan) Digest(ref string) digest.Digest { return p.digests[ref] }
