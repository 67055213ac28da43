// Command e2e-node starts the way a patched k3s agent does, minus k3s: containerd is up (the
// test started it), the k3s-pinning agent loads and pins the images dir, the kubelet image GC
// filter (patches/kubernetes) is registered with the agent's keep-decision, then the kubelet runs
// in this same process, built from the vendored, patched k8s.io/kubernetes.
//
//	e2e-node --containerd-address A --images-dir D [--agent run|sync|off] [--gc-filter] -- <kubelet flags>
//
// --agent run: sync, then the long-running agent (re-pin, restore); sync: one sync, nothing after
// (so a test can strip every pin and leave the filter alone); off: no k3s-pinning at all.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/sirupsen/logrus"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kubelet/app"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
	"github.com/k3s-pinning/k3s-pinning/test/kubelet/kubeletgc"
)

func main() {
	fs := flag.NewFlagSet("e2e-node", flag.ExitOnError)
	address := fs.String("containerd-address", "", "containerd socket")
	imagesDir := fs.String("images-dir", "", "the agent/images dir")
	stateFile := fs.String("state-file", "", "k3s-pinning state file")
	agentMode := fs.String("agent", "run", "run, sync or off")
	gcFilter := fs.Bool("gc-filter", true, "register the kubelet image GC filter")
	fs.Parse(os.Args[1:])
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	if *agentMode != "off" {
		client, err := containerd.New(*address)
		if err != nil {
			fail("containerd: %v", err)
		}
		agent := images.NewAgent(images.Services(client), images.Config{ImagesDir: *imagesDir, StateFile: *stateFile})
		nsCtx := namespaces.WithNamespace(ctx, pinning.DefaultNamespace)
		// k3s loads the images dir before it starts the kubelet.
		if err := agent.Sync(nsCtx).Err(); err != nil {
			fail("k3s-pinning sync: %v", err)
		}
		switch *agentMode {
		case "run":
			go func() {
				if err := agent.Run(nsCtx, images.RunOptions{Restore: true, Synced: true}); err != nil {
					logrus.Errorf("k3s-pinning agent: %v", err)
				}
			}()
		case "sync":
		default:
			fail("--agent %q: want run, sync or off", *agentMode)
		}
		if *gcFilter {
			kubeletgc.RegisterFilter(agent.Keeper())
			logrus.Infof("kubelet image GC filter %q registered", kubeletgc.FilterName)
		}
	}

	kubelet := app.NewKubeletCommand(ctx)
	kubelet.SetArgs(fs.Args())
	os.Exit(cli.Run(kubelet))
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "e2e-node: "+format+"\n", args...)
	os.Exit(1)
}
