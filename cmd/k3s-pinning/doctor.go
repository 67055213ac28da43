package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/urfave/cli/v2"

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
func findingsOf(s *images.Inspection) []finding {
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
			problem := fmt.Sprintf("wanted (%s) but missing from containerd", r.Source)
			if r.Source == pinning.SourcePolicy || r.Source == pinning.SourceWorkload || r.Source == "" || r.Retained {
				fix = "import it again by hand (`k3s ctr images import`), then run `k3s-pinning sync`"
			}
			if r.Retained {
				problem = fmt.Sprintf("wanted (%s, removed from the images dir, retained) but missing from containerd", r.Source)
			}
			if msg, ok := s.Agent.FetchErrors[r.Ref]; ok {
				problem += "; its fetch failed: " + msg
				fix = "make it reachable by digest: a node holding it with k3s's --embedded-registry, or a registries.yaml mirror; or import it by hand (`k3s ctr images import`). The agent retries with backoff"
			} else if slices.Contains(s.Agent.FetchesPending, r.Ref) {
				problem += "; a fetch is pending"
				fix = "wait: the running agent is fetching it by digest (--" + images.FlagFetchMissingImages + ")"
			}
			out = append(out, finding{Subject: r.Ref, Problem: problem, Fix: fix})
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
		out = append(out, finding{Subject: ref, Problem: "restore or fetch waiting: the disk holding containerd's root is full (or above --" + images.FlagFetchMaxDiskUsage + ")",
			Fix: "free space on the image filesystem; the agent retries with backoff and brings it back"})
	}
	if s.Agent.StateError != "" {
		out = append(out, finding{Subject: "state file", Problem: "cannot be written: " + s.Agent.StateError,
			Fix: "make the state dir writable or free space; until then the agent protects from memory and re-indexes at restart"})
	}
	if s.StateUnreadable != "" {
		out = append(out, finding{Subject: "state file", Problem: "cannot be read: " + s.StateUnreadable + "; nothing is unpinned for it",
			Fix: "none needed: the agent keeps it aside and writes the state again at its next sync (`k3s-pinning sync`, or the running agent's next reconcile)"})
	}
	for _, path := range s.StateSetAside {
		out = append(out, finding{Subject: path, Problem: "a state file that could not be read, kept aside; the agent rebuilt its state from containerd and unpinned nothing for it",
			Fix: "look at it if you want to know how it was damaged, then remove it"})
	}
	for _, m := range s.Misspelled {
		out = append(out, finding{Subject: m.Ref, Problem: "misspelled pin label " + m.Label + ": the image is not protected by it",
			Fix: fmt.Sprintf("add it to --pinned-images, or label it: ctr -n k8s.io images label %s %s=%s", m.Ref, pinning.LabelPinned, pinning.PinnedValue)})
	}
	return out
}

// doctorCommand is `k3s-pinning doctor`: what leaves an image unprotected, with the fix.
func doctorCommand(o *options, stdout io.Writer) *cli.Command {
	return &cli.Command{
		Name:  "doctor",
		Usage: "find what leaves an image unprotected and say how to fix it; exit 1 when anything is found",
		Flags: commonFlags(o),
		Action: func(c *cli.Context) error {
			return withAgent(c, o, func(ctx context.Context, a *images.Agent) error {
				snap, err := a.Inspect(ctx)
				if err != nil {
					return err
				}
				printRunStatus(stdout, snap.Agent)
				findings := findingsOf(snap)
				for _, f := range findings {
					fmt.Fprintf(stdout, "PROBLEM %s: %s\n    fix: %s\n", f.Subject, f.Problem, f.Fix)
				}
				if len(findings) > 0 {
					return cli.Exit(fmt.Sprintf("doctor: %d problem(s) found", len(findings)), exitProblem)
				}
				fmt.Fprintf(stdout, "ok: %d references, every wanted one present and pinned\n", len(snap.Refs))
				return nil
			})
		},
	}
}
