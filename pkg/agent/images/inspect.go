package images

import (
	"context"
	"fmt"
	"maps"
	"sort"

	"github.com/containerd/containerd/v2/core/images"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/keep"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// RefStatus is one reference as `k3s-pinning status` shows it. The JSON keys are a contract.
type RefStatus struct {
	Ref     string `json:"ref"`
	Digest  string `json:"digest"`
	Source  string `json:"source"`  // archive file name, "policy", "manual", or empty
	Pinned  bool   `json:"pinned"`  // the CRI pin label is set on this reference
	Wanted  bool   `json:"wanted"`  // k3s-pinning wants it kept
	Present bool   `json:"present"` // the reference exists in containerd
	// Retained: Source is an archive removed from the images dir whose references are kept
	// (--retain-removed-archive-images) until `k3s-pinning unpin`.
	Retained bool `json:"retained,omitempty"`
}

// Inspection is the node as the agent sees it: every reference present or wanted, the archives
// that failed to read, and pin labels the CRI ignores.
type Inspection struct {
	Refs          []RefStatus
	ArchiveErrors []error
	Misspelled    []Misspelling
	Conflicts     []keep.Conflict // references two archives provide with different images
	// Agent is the view of the running agent, from the state file (zero when none ran).
	Agent statefile.RunStatus
	// StateUnreadable is why the state file cannot be read, while it is where it was; the agent
	// sets it aside at its next save. StateSetAside are the unreadable state files kept aside.
	StateUnreadable string
	StateSetAside   []string
}

// Misspelling is a label on a reference that looks like a pin but that the CRI ignores.
type Misspelling struct {
	Ref, Label string
}

// Inspect reads the images dir and containerd and returns what is wanted, present and pinned. It
// changes nothing.
func (a *Agent) Inspect(ctx context.Context) (*Inspection, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	sv := a.survey()
	all, err := imagelist.List(ctx, a.cd.Images)
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	in := a.planInput(sv.present, sv.read)
	if a.stateLost { // as the next sync will rebuild it
		retained := &statefile.State{Retained: map[string]*statefile.Archive{}}
		for name, rec := range in.Retained {
			retained.Retained[name] = &statefile.Archive{Refs: maps.Clone(rec.Refs)}
		}
		retainWithPins(retained, retainedFromPins(all, sv.present, a.state))
		in.Retained = retained.Retained
	}
	plan := keep.New(in)
	snap := &Inspection{ArchiveErrors: sv.scanErrs, Conflicts: plan.Conflicts(), Agent: a.state.Agent}
	if a.stateUnreadable != nil {
		snap.StateUnreadable = a.stateUnreadable.Error()
	}
	if a.cfg.StateFile != "" {
		snap.StateSetAside = statefile.SetAsideFiles(a.cfg.StateFile)
	}
	for _, ar := range sv.archives {
		snap.ArchiveErrors = append(snap.ArchiveErrors, flatten(sv.errs[ar.Name()])...)
	}
	present := map[string]bool{}
	for img := range all.Images() {
		if imagelist.IsImageID(img.Name) {
			continue
		}
		present[img.Name] = true
		src, wanted := plan.Source(img)
		if label, ok := pinning.OwnPin(img.Labels); ok {
			src = label
		}
		snap.Refs = append(snap.Refs, RefStatus{
			Ref: img.Name, Digest: img.Target.Digest.String(), Source: src,
			Pinned: pinning.IsPinned(img.Labels), Wanted: wanted, Present: true, Retained: plan.Retained(src),
		})
		if m := pinning.MisspelledPin(img.Labels); m != "" {
			snap.Misspelled = append(snap.Misspelled, Misspelling{Ref: img.Name, Label: m})
		}
	}
	for ref, src := range plan.Provided() {
		if !present[ref] {
			snap.Refs = append(snap.Refs, RefStatus{Ref: ref, Digest: plan.Digest(ref).String(), Source: src, Wanted: true, Retained: plan.Retained(src)})
		}
	}
	if a.cfg.Fetch { // wanted wherever they are: missing here until fetched
		for ref, d := range plan.Fetchables() {
			if _, provided := plan.Provided()[ref]; !present[ref] && !provided {
				src, _ := plan.Source(images.Image{Name: ref})
				snap.Refs = append(snap.Refs, RefStatus{Ref: ref, Digest: d.String(), Source: src, Wanted: true})
			}
		}
	}
	sort.Slice(snap.Refs, func(i, j int) bool { return snap.Refs[i].Ref < snap.Refs[j].Ref })
	return snap, nil
}

// flatten splits joined errors, so that each bad line of a list is its own finding.
func flatten(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, flatten(e)...)
		}
		return out
	}
	return []error{err}
}
