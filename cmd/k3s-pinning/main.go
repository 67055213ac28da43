// Command k3s-pinning gives a stock k3s node the protection of a k3s built with k3s-pinning:
// every image from the air-gap images dir is imported pinned, and hand imports named by policy
// are pinned too, so the kubelet's image GC never deletes them.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/sirupsen/logrus"
	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/k3spinning"
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
		&cli.StringFlag{Name: "state-file", Value: statefile.DefaultPath, Usage: "what each archive provided, kept across restarts (outside the images dir)", Destination: &o.stateFile},
		&cli.StringSliceFlag{Name: "airgap-extra-registry", Usage: "also tag imported images under this registry, as k3s --airgap-extra-registry does", Destination: &o.extraRegistries},
	}, k3spinning.PolicyFlags(&o.policy, "K3S")...)
}

// runMemoryLimit is `run`'s soft memory limit (runtime/debug.SetMemoryLimit) unless GOMEMLIMIT
// is set. It bounds the Go runtime's memory, not the binary's pages. Derived from a first sync at
// 10,000 references, which holds at most 28 MB live: of the limits tried on it, 36 MiB gave the
// lowest peak before the sync itself slowed (the measurements are in this line's git history).
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
			syncCommand(o, stdout),
			runCommand(o, stdout),
			statusCommand(o, stdout),
			doctorCommand(o, stdout),
			pinCommand(o, stdout),
			unpinCommand(o, stdout),
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
