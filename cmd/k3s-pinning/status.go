package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/cluster"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
)

// statusCommand is `k3s-pinning status`: every reference of this node, or with --cluster every
// node's condition.
func statusCommand(o *options, stdout io.Writer) *cli.Command {
	return &cli.Command{
		Name:  "status",
		Usage: "one row per reference: ref, digest, source, pinned, wanted, present",
		Flags: append(commonFlags(o), &cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "table", Usage: "table or json", Destination: &o.output},
			&cli.BoolFlag{Name: "cluster", Usage: "one row per node of the cluster, from the " + string(cluster.ConditionType) + " condition k3s-pinning keeps on it; exit 1 when any node is not protected", Destination: &o.cluster},
			&cli.StringFlag{Name: "kubeconfig", Usage: "with --cluster: the kubeconfig (default $KUBECONFIG, else " + cluster.DefaultKubeconfig + ")", Destination: &o.kubeconfig}),
		Action: func(c *cli.Context) error {
			if o.output != "table" && o.output != "json" {
				return cli.Exit(fmt.Sprintf("--output %q: must be table or json", o.output), exitUsage)
			}
			if o.cluster {
				return statusCluster(c.Context, stdout, o)
			}
			return withAgent(c, o, func(ctx context.Context, a *images.Agent) error {
				snap, err := a.Inspect(ctx)
				if err != nil {
					return err
				}
				if o.output == "json" {
					refs := snap.Refs
					if refs == nil {
						refs = []images.RefStatus{}
					}
					enc := json.NewEncoder(stdout)
					enc.SetIndent("", "  ")
					return enc.Encode(struct {
						Images []images.RefStatus `json:"images"`
					}{refs})
				}
				tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "REF\tDIGEST\tSOURCE\tPINNED\tWANTED\tPRESENT")
				for _, r := range snap.Refs {
					source := dash(r.Source)
					if r.Retained {
						source += " (retained)"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%t\t%t\t%t\n", r.Ref, shortDigest(r.Digest), source, r.Pinned, r.Wanted, r.Present)
				}
				if err := tw.Flush(); err != nil {
					return err
				}
				printRunStatus(stdout, snap.Agent)
				return nil
			})
		},
	}
}

// printRunStatus shows what the running agent (`run`) last recorded in the state file.
func printRunStatus(w io.Writer, v statefile.RunStatus) {
	if v.LastReconcile.IsZero() {
		fmt.Fprintln(w, "agent: no reconcile recorded in the state file")
		return
	}
	fmt.Fprintf(w, "agent: last reconcile %s; restores done %d, failed %d, pending %d, waiting for disk %d; archives failing %d\n",
		v.LastReconcile.Format(time.RFC3339), v.RestoresDone, v.RestoresFailed, len(v.RestoresPending), len(v.WaitingForDisk), len(v.ArchiveErrors))
	for _, name := range slices.Sorted(maps.Keys(v.ArchiveErrors)) {
		fmt.Fprintf(w, "agent: archive %s: %s\n", name, v.ArchiveErrors[name])
	}
	if v.FetchesDone+v.FetchesFailed+len(v.FetchesPending) > 0 {
		fmt.Fprintf(w, "agent: fetches done %d, failed %d, pending %d\n", v.FetchesDone, v.FetchesFailed, len(v.FetchesPending))
	}
	for _, ref := range slices.Sorted(maps.Keys(v.FetchErrors)) {
		fmt.Fprintf(w, "agent: fetch %s: %s\n", ref, v.FetchErrors[ref])
	}
	if v.StateError != "" {
		fmt.Fprintf(w, "agent: state file not written: %s\n", v.StateError)
	}
}

func shortDigest(d string) string {
	if len(d) > 19 {
		return d[:19]
	}
	return dash(d)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
