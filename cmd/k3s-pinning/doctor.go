package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// finding is one thing that leaves an image unprotected, with the fix.
type finding struct {
	Subject string // the reference or file
	Problem string
	Fix     string
}

// findingsOf are the problems in the snapshot, as doctor reports them, each with the command or
// change that fixes it.
func findingsOf(s *images.Snapshot) []finding {
	var out []finding
	for _, err := range s.ArchiveErrors {
		subject := err.Error()
		var ae *airgap.ArchiveError
		if errors.As(err, &ae) {
			subject = ae.Path
			if ae.Line > 0 {
				subject = fmt.Sprintf("%s:%d", ae.Path, ae.Line)
			}
		}
		out = append(out, finding{Subject: subject, Problem: "cannot be loaded: " + err.Error(),
			Fix: "replace it with a complete image archive (" + strings.Join(airgap.SupportedExtensions, " ") + ") or remove it; the other archives are not affected"})
	}
	for _, r := range s.Refs {
		switch {
		case r.Wanted && !r.Present:
			fix := "run `k3s-pinning sync` to import it again from " + r.Source
			if r.Source == pinning.SourcePolicy || r.Source == "" {
				fix = "import it again by hand (`k3s ctr images import`), then run `k3s-pinning sync`"
			}
			out = append(out, finding{Subject: r.Ref, Problem: fmt.Sprintf("wanted (%s) but missing from containerd", r.Source), Fix: fix})
		case r.Wanted && !r.Pinned:
			out = append(out, finding{Subject: r.Ref, Problem: fmt.Sprintf("wanted (%s) but not pinned: the kubelet may delete it under disk pressure", r.Source),
				Fix: "run `k3s-pinning sync`"})
		}
	}
	for _, c := range s.Conflicts {
		out = append(out, finding{Subject: c.Ref, Problem: "two archives provide it with different images: " + c.String(),
			Fix: "remove it from one archive, or rename the archives so that the one you want sorts first"})
	}
	for _, ref := range s.Agent.WaitingForDisk {
		out = append(out, finding{Subject: ref, Problem: "restore waiting: the disk holding containerd's root is full",
			Fix: "free space on the image filesystem; the agent retries with backoff and restores it"})
	}
	if s.Agent.StateError != "" {
		out = append(out, finding{Subject: "state file", Problem: "cannot be written: " + s.Agent.StateError,
			Fix: "make the state dir writable or free space; until then the agent protects from memory and re-indexes at restart"})
	}
	for _, m := range s.Misspelled {
		out = append(out, finding{Subject: m.Ref, Problem: "misspelled pin label " + m.Label + ": the image is not protected by it",
			Fix: fmt.Sprintf("add it to --pinned-images, or label it: ctr -n k8s.io images label %s %s=%s", m.Ref, pinning.LabelPinned, pinning.PinnedValue)})
	}
	return out
}
