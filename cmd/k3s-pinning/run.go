package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"github.com/urfave/cli/v2"
	"golang.org/x/sync/errgroup"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/cluster"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// runCommand is `k3s-pinning run`, the daemon: a sync, then the agent until SIGTERM, with the
// metrics and health server and the cluster view when asked.
func runCommand(o *options, stdout io.Writer) *cli.Command {
	return &cli.Command{
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
				// keep their pages for minutes, several times the heap in use. A forced
				// collection after each sync (at start, every reconcile interval, on
				// resync) returns them now.
				o.run.AfterSync = debug.FreeOSMemory
				if os.Getenv("GOMEMLIMIT") == "" {
					// Left alone, the runtime lets the heap grow to twice what a sync
					// holds live before it collects. A soft limit makes it collect sooner;
					// above it, it collects at most half the CPU's time. GOMEMLIMIT, when
					// set, is the operator's.
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
	}
}
