package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// syncCommand is `k3s-pinning sync`: one sync, its summary, exit 1 when an archive failed.
func syncCommand(o *options, stdout io.Writer) *cli.Command {
	return &cli.Command{
		Name:  "sync",
		Usage: "import what is not imported yet, pin everything wanted, print a summary; exit 0 only when every archive was processed",
		Flags: commonFlags(o),
		Action: func(c *cli.Context) error {
			return withAgent(c, o, func(ctx context.Context, a *images.Agent) error {
				report := a.Sync(ctx)
				printSync(stdout, report)
				if err := report.Err(); err != nil {
					return cli.Exit("sync: not every archive was processed (see above)", exitProblem)
				}
				return nil
			})
		},
	}
}

func printSync(w io.Writer, r *images.SyncReport) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ARCHIVE\tFORMAT\tREFS\tIMPORTED\tPINNED NOW\tRESULT")
	for _, a := range r.Archives {
		pinnedNow, failed := 0, 0
		for _, ref := range a.Refs {
			if ref.Err != nil {
				failed++
			} else if ref.Result == pinning.Pinned {
				pinnedNow++
			}
		}
		result := "ok"
		if a.Err != nil {
			result = "FAILED: " + a.Err.Error()
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%t\t%d\t%s\n", a.Archive.Name(), dash(string(a.Format)), len(a.Refs)-failed, a.Imported, pinnedNow, result)
	}
	for _, err := range r.ScanErrors {
		fmt.Fprintf(tw, "%s\t-\t0\tfalse\t0\tFAILED\n", err)
	}
	tw.Flush()
	for _, a := range r.Archives {
		for _, c := range a.Shadowed {
			fmt.Fprintf(w, "conflict: %v\n", c)
		}
	}
	if len(r.PolicyPinned) > 0 || r.PolicyErr != nil {
		fmt.Fprintf(w, "policy: %d hand-imported reference(s) pinned now\n", len(r.PolicyPinned))
	}
	if r.PolicyErr != nil {
		fmt.Fprintf(w, "policy: FAILED: %v\n", r.PolicyErr)
	}
}
