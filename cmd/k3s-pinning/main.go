// Command k3s-pinning gives a stock k3s node the protection of a k3s built with k3s-pinning:
// every image from the air-gap images dir is imported pinned, and hand imports named by policy
// are pinned too, so the kubelet's image GC never deletes them.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/urfave/cli/v2"
	"golang.org/x/sync/errgroup"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/cluster"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// version is set at build time (make release: -X main.version=...), as k3s sets its own.
var version = "dev"

// Exit codes: 0 all good, 1 something needs attention (sync failed on an archive, doctor found a
// problem, unpin refused), 2 bad usage or containerd unreachable.
const (
	exitProblem = 1
	exitUsage   = 2
)

type options struct {
	address, imagesDir, namespace, stateFile string
	extraRegistries                          cli.StringSlice
	policy                                   images.PolicyValues
	output, metricsAddress                   string
	run                                      images.RunOptions
	// the cluster view: where Events and the node condition go (run), what status --cluster reads
	kubeconfig, nodeName string
	inCluster, cluster   bool
	reporter             images.Reporter
}

// commonFlags are accepted by every subcommand after its own name.
func commonFlags(o *options) []cli.Flag {
	return append([]cli.Flag{
		&cli.StringFlag{Name: "containerd-address", Value: "/run/k3s/containerd/containerd.sock", Usage: "containerd socket (k3s's own by default)", Destination: &o.address},
		&cli.StringFlag{Name: "images-dir", Value: images.DefaultImagesDir, Usage: "air-gap images dir", Destination: &o.imagesDir},
		&cli.StringFlag{Name: "namespace", Value: pinning.DefaultNamespace, Usage: "containerd namespace (the CRI uses k8s.io)", Destination: &o.namespace},
		&cli.StringFlag{Name: "state-file", Value: images.DefaultStateFile, Usage: "what each archive provided, kept across restarts (outside the images dir)", Destination: &o.stateFile},
		&cli.StringSliceFlag{Name: "airgap-extra-registry", Usage: "also tag imported images under this registry, as k3s --airgap-extra-registry does", Destination: &o.extraRegistries},
	}, images.PolicyFlags(&o.policy, "K3S")...)
}

// runMemoryLimit is `run`'s soft memory limit (runtime/debug.SetMemoryLimit) unless GOMEMLIMIT
// is set. It bounds the Go runtime's memory, not the binary's pages (another 23-25 MiB resident,
// built as released). A first sync at 10,000 references holds at most 28 MB live (2026-12-06,
// runtime/metrics with the heap profiler on, its own records counted: the store's list, the loads'
// reports, the content walk, the state's records); limits tried on that sync, VmHWM: 48 MiB 67.7,
// 44 MiB 63.7, 40 MiB 61.3-63.5, 36 MiB 60.7-62.7 with the sync 1.3-1.4 s, 32 MiB 59.7 (1.5 s);
// 75.4-75.8 MiB at the 56 MiB this limit was before.
const runMemoryLimit = 36 << 20

func main() {
	logrus.SetOutput(os.Stderr)
	app := newApp(os.Stdout)
	if err := app.Run(flagsFirst(app, os.Args)); err != nil {
		var ec cli.ExitCoder
		if errors.As(err, &ec) {
			fmt.Fprintln(os.Stderr, "k3s-pinning:", err)
			os.Exit(ec.ExitCode())
		}
		fmt.Fprintln(os.Stderr, "k3s-pinning:", err)
		os.Exit(exitUsage)
	}
}

func newApp(stdout io.Writer) *cli.App {
	o := &options{}
	return &cli.App{
		Name:    "k3s-pinning",
		Version: version,
		Usage:   "keep k3s air-gap images pinned so the kubelet never deletes them",
		OnUsageError: func(c *cli.Context, err error, _ bool) error {
			return cli.Exit(err.Error(), exitUsage)
		},
		Commands: []*cli.Command{
			{
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
			},
			{
				Name:  "run",
				Usage: "sync, then keep every wanted image present and pinned until SIGTERM: re-pin, restore from the archive, follow the images dir",
				Flags: append(commonFlags(o),
					&cli.DurationFlag{Name: "reconcile-interval", Value: images.DefaultReconcileInterval, Usage: "period of the full reconcile behind the events", Destination: &o.run.ReconcileInterval},
					&cli.BoolFlag{Name: "restore", Value: true, Usage: "re-import a wanted image that was deleted, from its archive", Destination: &o.run.Restore},
					&cli.StringFlag{Name: "metrics-address", Usage: "serve Prometheus /metrics here (a bare :port listens on 127.0.0.1)", Destination: &o.metricsAddress},
					&cli.StringFlag{Name: "kubeconfig", EnvVars: []string{"K3S_PINNING_KUBECONFIG"}, Usage: "report Events and the " + string(cluster.ConditionType) + " condition on this node's Node object with this kubeconfig (its user may create events and patch nodes/status)", Destination: &o.kubeconfig},
					&cli.BoolFlag{Name: "in-cluster", Usage: "report as --kubeconfig does, with the pod's service account (the DaemonSet); needs --node-name", Destination: &o.inCluster},
					&cli.StringFlag{Name: "node-name", EnvVars: []string{"NODE_NAME"}, Usage: "the Node to report on (default: the host name in lower case, as k3s)", Destination: &o.nodeName},
				),
				Action: func(c *cli.Context) error {
					if err := cluster.CheckWorkloadScope(o.policy.WorkloadScope()); err != nil {
						return cli.Exit(fmt.Sprintf("run: %v", err), exitUsage)
					}
					reporter, err := reporterFor(o)
					if err != nil {
						return cli.Exit(fmt.Sprintf("run: %v", err), exitUsage)
					}
					if o.policy.PinnedWorkloadImages && reporter == nil {
						return cli.Exit("run: --"+images.FlagPinnedWorkloadImages+" reads the cluster's workloads: give --kubeconfig or --in-cluster", exitUsage)
					}
					if reporter != nil {
						o.reporter = reporter
					}
					return withAgent(c, o, func(ctx context.Context, a *images.Agent) error {
						ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
						defer stop()
						// The agent and the metrics server end together: a server that cannot
						// listen stops the agent, which saves its state on the way out.
						g, ctx := errgroup.WithContext(ctx)
						interval := o.run.ReconcileInterval
						if interval <= 0 {
							interval = images.DefaultReconcileInterval // as Run takes it
						}
						stallAfter := images.StalledIntervals * interval
						if o.metricsAddress != "" {
							registry := prometheus.NewRegistry()
							registry.MustRegister(a.Metrics())
							g.Go(func() error {
								h := health{started: time.Now(), reconciled: a.Reconciled, stallAfter: stallAfter}
								if err := serveHTTP(ctx, o.metricsAddress, registry, h); err != nil {
									return fmt.Errorf("metrics on %s: %w", o.metricsAddress, err)
								}
								return nil
							})
						}
						logrus.Infof("k3s-pinning run: protecting %s on %s", o.imagesDir, o.address)
						// A sync's lists of the store are garbage once it ends; the runtime would
						// keep their pages for minutes (167 MiB resident at 10,000 references
						// with 35 MiB of heap in use). A forced collection after each sync (at
						// start, every reconcile interval, on resync) returns them now.
						o.run.AfterSync = debug.FreeOSMemory
						if os.Getenv("GOMEMLIMIT") == "" {
							// Left alone, the runtime lets the heap grow to twice what a sync
							// holds live before it collects (VmHWM 188 MiB at 10,000 references).
							// A soft limit makes it collect sooner; above it, it collects at most
							// half the CPU's time. GOMEMLIMIT, when set, is the operator's.
							debug.SetMemoryLimit(runMemoryLimit)
						}
						if reporter != nil {
							reporter.WatchReconciles(a.Reconciled, stallAfter)
							g.Go(func() error { reporter.Run(ctx); return nil })
						}
						if o.policy.PinnedWorkloadImages {
							g.Go(func() error { reporter.WatchWorkloads(ctx, o.policy.WorkloadScope(), a.SetWorkloadImages); return nil })
						}
						g.Go(func() error { return watchSocketReplaced(ctx, o.address, socketCheckInterval) })
						g.Go(func() error { return a.Run(ctx, o.run) })
						return g.Wait()
					})
				},
			},
			{
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
						printAgentView(stdout, snap.Agent)
						return nil
					})
				},
			},
			{
				Name:  "doctor",
				Usage: "find what leaves an image unprotected and say how to fix it; exit 1 when anything is found",
				Flags: commonFlags(o),
				Action: func(c *cli.Context) error {
					return withAgent(c, o, func(ctx context.Context, a *images.Agent) error {
						snap, err := a.Inspect(ctx)
						if err != nil {
							return err
						}
						printAgentView(stdout, snap.Agent)
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
			},
			{
				Name:      "pin",
				Usage:     "pin references by hand (recorded as source \"manual\")",
				ArgsUsage: "REF...",
				Flags:     commonFlags(o),
				Action: func(c *cli.Context) error {
					return eachRef(c, o, func(ctx context.Context, a *images.Agent, ref string) error {
						res, err := a.PinManual(ctx, ref)
						if err == nil {
							fmt.Fprintf(stdout, "%s: %s\n", ref, res)
						}
						return err
					})
				},
			},
			{
				Name:      "unpin",
				Usage:     "remove pins k3s-pinning set; a pin set by anyone else is never removed",
				ArgsUsage: "REF...",
				Flags:     commonFlags(o),
				Action: func(c *cli.Context) error {
					return eachRef(c, o, func(ctx context.Context, a *images.Agent, ref string) error {
						wantedBy, err := a.UnpinManual(ctx, ref)
						if err != nil {
							return err
						}
						fmt.Fprintf(stdout, "%s: unpinned\n", ref)
						if wantedBy != "" {
							fmt.Fprintf(stdout, "%s: note: %s still wants it; the next sync pins it again\n", ref, wantedBy)
						}
						return nil
					})
				},
			},
		},
	}
}

// withAgent connects to containerd, checks it answers, and runs fn with the namespace in ctx.
func withAgent(c *cli.Context, o *options, fn func(context.Context, *images.Agent) error) error {
	policy, err := o.policy.Policy()
	if err != nil {
		return cli.Exit(err.Error(), exitUsage)
	}
	if _, err := os.Stat(o.address); err != nil {
		return cli.Exit(fmt.Sprintf("containerd socket: %v (set --containerd-address)", err), exitUsage)
	}
	client, err := images.Connect(o.address)
	if err != nil {
		return cli.Exit(fmt.Sprintf("containerd at %s: %v", o.address, err), exitUsage)
	}
	defer client.Close()
	ctx := namespaces.WithNamespace(c.Context, o.namespace)
	vctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := client.Version(vctx); err != nil {
		return cli.Exit(fmt.Sprintf("containerd at %s does not answer: %v", o.address, err), exitUsage)
	}
	agent := images.NewAgent(images.Services(client), o.policy.AgentConfig(images.Config{ImagesDir: o.imagesDir, Policy: policy, ExtraRegistries: o.extraRegistries.Value(), StateFile: o.stateFile, Reporter: o.reporter}))
	return fn(ctx, agent)
}

func eachRef(c *cli.Context, o *options, fn func(context.Context, *images.Agent, string) error) error {
	if c.NArg() == 0 {
		return cli.Exit(c.Command.Name+": name at least one image reference", exitUsage)
	}
	return withAgent(c, o, func(ctx context.Context, a *images.Agent) error {
		failed := 0
		for _, ref := range c.Args().Slice() {
			if err := fn(ctx, a, ref); err != nil {
				failed++
				if errors.Is(err, pinning.ErrNotOurs) {
					err = fmt.Errorf("%w; k3s-pinning never removes a pin it did not set", err)
				}
				fmt.Fprintf(os.Stderr, "%s: %v\n", ref, err)
			}
		}
		if failed > 0 {
			return cli.Exit(fmt.Sprintf("%s: %d of %d failed", c.Command.Name, failed, c.NArg()), exitProblem)
		}
		return nil
	})
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

// printAgentView shows what the running agent (`run`) last recorded in the state file.
func printAgentView(w io.Writer, v images.AgentView) {
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

// flagsFirst moves the flags of a subcommand ahead of its references, so that
// `k3s-pinning pin REF --containerd-address S` works: urfave/cli stops reading flags at the first
// argument. A flag of the subcommand takes the next token as its value unless it is a boolean
// (--cluster, --in-cluster, --restore, ...) or written with "="; help and unknown flags take none
// (an unknown flag is then named by urfave/cli's error, not its neighbour).
func flagsFirst(app *cli.App, args []string) []string {
	if len(args) < 3 {
		return args
	}
	takesValue := map[string]bool{}
	if cmd := app.Command(args[1]); cmd != nil {
		for _, f := range cmd.Flags {
			_, isBool := f.(*cli.BoolFlag)
			for _, name := range f.Names() {
				takesValue[name] = !isBool
			}
		}
	}
	var flags, refs []string
	rest := args[2:]
	for i := 0; i < len(rest); i++ {
		a := rest[i]
		switch {
		case a == "--":
			refs = append(refs, rest[i+1:]...)
			i = len(rest)
		case strings.HasPrefix(a, "-") && len(a) > 1:
			flags = append(flags, a)
			if !strings.Contains(a, "=") && takesValue[strings.TrimLeft(a, "-")] && i+1 < len(rest) {
				i++
				flags = append(flags, rest[i])
			}
		default:
			refs = append(refs, a)
		}
	}
	out := append([]string{args[0], args[1]}, flags...)
	return append(out, refs...)
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
