package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"

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
}

// Snapshot is the node as the agent sees it: every reference present or wanted, the archives
// that failed to read, and pin labels the CRI ignores.
type Snapshot struct {
	Refs          []RefStatus
	ArchiveErrors []error
	Misspelled    []Misspelling
	Conflicts     []Conflict // references two archives provide with different images
	// Agent is the view of the running agent, from the state file (zero when none ran).
	Agent  AgentView
	wanted *wantedSet
}

// Misspelling is a label on a reference that looks like a pin but that the CRI ignores.
type Misspelling struct {
	Ref, Label string
}

// Inspect reads the images dir and containerd and returns what is wanted, present and pinned. It
// changes nothing.
func (a *Agent) Inspect(ctx context.Context) (*Snapshot, error) {
	snap := &Snapshot{}
	archives, errs := Scan(a.cfg.ImagesDir)
	snap.ArchiveErrors = errs
	var indexes, claims []*Index
	var inDir []string
	for _, ar := range archives {
		inDir = append(inDir, ar.Name())
		idx, _, err := a.index(ar)
		if err != nil {
			snap.ArchiveErrors = append(snap.ArchiveErrors, flatten(err)...)
		}
		if idx != nil {
			indexes = append(indexes, idx)
			claims = append(claims, idx)
		} else if rec := a.state.Archives[ar.Name()]; rec != nil {
			claims = append(claims, rec.index(ar))
		}
	}
	snap.Conflicts = ownership(claims).conflicts
	snap.wanted = newWantedSet(inDir, indexes, a.state, a.cfg.Policy, a.cfg.ExtraRegistries)
	snap.Agent = a.state.Agent

	all, err := a.client.ImageService().List(ctx)
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	present := map[string]bool{}
	for _, img := range all {
		if isImageIDRecord(img.Name) {
			continue
		}
		present[img.Name] = true
		src, wanted := snap.wanted.source(img)
		if label, ok := pinning.OwnPin(img.Labels); ok {
			src = label
		}
		snap.Refs = append(snap.Refs, RefStatus{
			Ref: img.Name, Digest: img.Target.Digest.String(), Source: src,
			Pinned: pinning.IsPinned(img.Labels), Wanted: wanted, Present: true,
		})
		if m := pinning.MisspelledPin(img.Labels); m != "" {
			snap.Misspelled = append(snap.Misspelled, Misspelling{Ref: img.Name, Label: m})
		}
	}
	for _, ref := range slices.Sorted(maps.Keys(snap.wanted.refs)) {
		if present[ref] {
			continue
		}
		dgst := ""
		if rec := a.state.Archives[snap.wanted.refs[ref]]; rec != nil {
			dgst = rec.Refs[ref].String()
		}
		for _, idx := range indexes {
			for _, img := range idx.Images {
				if img.Ref == ref && img.Digest != "" {
					dgst = img.Digest.String()
				}
			}
		}
		snap.Refs = append(snap.Refs, RefStatus{Ref: ref, Digest: dgst, Source: snap.wanted.refs[ref], Wanted: true})
	}
	sort.Slice(snap.Refs, func(i, j int) bool { return snap.Refs[i].Ref < snap.Refs[j].Ref })
	return snap, nil
}

// isImageIDRecord matches the sha256:<config digest> records the CRI creates beside each image.
func isImageIDRecord(name string) bool { return strings.HasPrefix(name, "sha256:") }

// Finding is one thing that leaves an image unprotected, with the fix.
type Finding struct {
	Subject string // the reference or file
	Problem string
	Fix     string
}

// Findings are the problems in the snapshot, as `k3s-pinning doctor` reports them.
func (s *Snapshot) Findings() []Finding {
	var out []Finding
	for _, err := range s.ArchiveErrors {
		subject := err.Error()
		var ae *ArchiveError
		if errors.As(err, &ae) {
			subject = ae.Path
			if ae.Line > 0 {
				subject = fmt.Sprintf("%s:%d", ae.Path, ae.Line)
			}
		}
		out = append(out, Finding{Subject: subject, Problem: "cannot be loaded: " + err.Error(),
			Fix: "replace it with a complete image archive (" + strings.Join(SupportedExtensions, " ") + ") or remove it; the other archives are not affected"})
	}
	for _, r := range s.Refs {
		switch {
		case r.Wanted && !r.Present:
			fix := "run `k3s-pinning sync` to import it again from " + r.Source
			if r.Source == pinning.SourcePolicy || r.Source == "" {
				fix = "import it again by hand (`k3s ctr images import`), then run `k3s-pinning sync`"
			}
			out = append(out, Finding{Subject: r.Ref, Problem: fmt.Sprintf("wanted (%s) but missing from containerd", r.Source), Fix: fix})
		case r.Wanted && !r.Pinned:
			out = append(out, Finding{Subject: r.Ref, Problem: fmt.Sprintf("wanted (%s) but not pinned: the kubelet may delete it under disk pressure", r.Source),
				Fix: "run `k3s-pinning sync`"})
		}
	}
	for _, c := range s.Conflicts {
		out = append(out, Finding{Subject: c.Ref, Problem: "two archives provide it with different images: " + c.String(),
			Fix: "remove it from one archive, or rename the archives so that the one you want sorts first"})
	}
	for _, ref := range s.Agent.WaitingForDisk {
		out = append(out, Finding{Subject: ref, Problem: "restore waiting: the disk holding containerd's root is full",
			Fix: "free space on the image filesystem; the agent retries with backoff and restores it"})
	}
	if s.Agent.StateError != "" {
		out = append(out, Finding{Subject: "state file", Problem: "cannot be written: " + s.Agent.StateError,
			Fix: "make the state dir writable or free space; until then the agent protects from memory and re-indexes at restart"})
	}
	for _, m := range s.Misspelled {
		out = append(out, Finding{Subject: m.Ref, Problem: "misspelled pin label " + m.Label + ": the image is not protected by it",
			Fix: fmt.Sprintf("add it to --pinned-images, or label it: ctr -n k8s.io images label %s %s=%s", m.Ref, pinning.LabelPinned, pinning.PinnedValue)})
	}
	return out
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
