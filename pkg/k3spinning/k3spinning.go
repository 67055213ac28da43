// Package k3spinning is what a k3s built with k3s-pinning imports, and all it imports: the flags
// k3s adds to `k3s server` and `k3s agent` (Flags, filling Settings), and Start, which takes over
// agent/images in place of k3s's PreloadImages import and returns the kubelet GC filter's
// keep-decision. The agent itself is package images; the cluster view (Events, the node
// condition, the workloads' images) is package cluster, which Start wires to the agent's kubelet
// kubeconfig. The daemon (cmd/k3s-pinning) takes its policy flags from here too (PolicyFlags).
package k3spinning

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/cluster"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/keep"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Config is what a patched k3s passes: from its agent configuration (config.Node) and the values
// of the k3s-pinning flags (Flags), all plain values.
type Config struct {
	Address         string   // cfg.Containerd.Address
	ImagesDir       string   // cfg.Images
	ExtraRegistries []string // cfg.AgentConfig.AirgapExtraRegistry
	// Kubeconfig and NodeName (cfg.AgentConfig.KubeConfigKubelet and NodeName) are the node's
	// own credentials and name: with them Start reports to the node's Node object (Events, the
	// AirgapImagesProtected condition, retried until the node has registered) and, with
	// --pinned-workload-images, reads the workloads in scope. Empty: neither.
	Kubeconfig string
	NodeName   string
	// StateFile defaults to k3s-pinning/state.json beside the images dir (agent/), outside it.
	StateFile string
	// Reporter and WatchWorkloads, when set, are used in place of the node's (tests, or a
	// distro with a cluster view of its own).
	Reporter       images.Reporter
	WatchWorkloads images.WorkloadWatcher
	Settings
}

// Start takes over the images dir for k3s, in place of its PreloadImages import and watcher.
// Like PreloadImages it returns once what the images dir holds is imported (and pinned, from the
// moment each reference is created); it then keeps everything wanted present and pinned until ctx
// ends: re-pin, restore from the archive, follow the dir. k3s's own pins (io.cattle.k3s.pinned)
// are adopted rather than cleared, so a restart never leaves an image unpinned: a pinned image
// the images dir still provides becomes ours without its CRI pin being touched, and the pin of one
// it no longer provides is cleared, as k3s does at start. The Keeper is the kubelet image GC
// filter's keep-decision; register it before the kubelet starts. done yields the agent's result
// once it has stopped after ctx ended, every goroutine ended and the connection closed.
//
// On Windows it returns an error that matches errors.ErrUnsupported, before touching anything: the
// package builds there (k3s builds Windows agents), but it has not been run on a Windows node, so
// the patched k3s leaves agent/images to its own import.
func Start(ctx context.Context, cfg Config) (keeper *keep.Keeper, done <-chan error, err error) {
	if runtime.GOOS == "windows" {
		return nil, nil, fmt.Errorf("k3s-pinning: not supported on windows: %w", errors.ErrUnsupported)
	}
	if cfg.DisableImagePinning {
		return nil, nil, fmt.Errorf("k3s-pinning: --%s is set; k3s imports the images dir itself", images.FlagDisableImagePinning)
	}
	policy, err := cfg.Policy()
	if err != nil {
		return nil, nil, fmt.Errorf("k3s-pinning: %w", err)
	}
	if cfg.StateFile == "" {
		cfg.StateFile = filepath.Join(filepath.Dir(cfg.ImagesDir), "k3s-pinning", "state.json")
	}
	if cfg.Reporter == nil && cfg.Kubeconfig != "" {
		if node, err := cluster.ForKubeconfig(cfg.Kubeconfig, cfg.NodeName); err != nil {
			logrus.Warnf("k3s-pinning: no Events, node condition or workload images: %v", err)
		} else {
			cfg.Reporter = node
			if cfg.WatchWorkloads == nil {
				cfg.WatchWorkloads = node.WatchWorkloads
			}
			go node.Run(ctx)
		}
	}
	client, err := images.Connect(cfg.Address)
	if err != nil {
		return nil, nil, fmt.Errorf("k3s-pinning: containerd at %s: %w", cfg.Address, err)
	}
	ctx = namespaces.WithNamespace(ctx, pinning.DefaultNamespace)
	agent := images.NewAgent(images.Services(client), cfg.PolicyValues.AgentConfig(images.Config{ImagesDir: cfg.ImagesDir, Policy: policy, ExtraRegistries: cfg.ExtraRegistries, StateFile: cfg.StateFile, Reporter: cfg.Reporter}))
	start := time.Now()
	report := agent.Sync(ctx)
	if err := report.Err(); err != nil {
		logrus.Errorf("k3s-pinning: not every file of %s was loaded (the others were): %v", cfg.ImagesDir, err)
	}
	if err := agent.AdoptK3sPins(ctx); err != nil {
		logrus.Errorf("k3s-pinning: %v", err)
	}
	logrus.Infof("k3s-pinning: %s loaded and pinned in %s; following it", cfg.ImagesDir, time.Since(start).Round(time.Millisecond))
	if w, ok := cfg.Reporter.(images.ReconcileWatcher); ok {
		w.WatchReconciles(agent.Reconciled, images.StalledIntervals*images.DefaultReconcileInterval)
	}
	if cfg.PinnedWorkloadImages {
		if cfg.WatchWorkloads == nil {
			logrus.Errorf("k3s-pinning: --%s: no connection to the cluster was given; keeping the images dir and the policy only", images.FlagPinnedWorkloadImages)
		} else {
			go cfg.WatchWorkloads(ctx, cfg.WorkloadScope(), agent.SetWorkloadImages)
		}
	}
	result := make(chan error, 1)
	go func() {
		err := agent.Run(ctx, images.RunOptions{Restore: !cfg.DisableImageRestore, Synced: true})
		if err != nil {
			logrus.Errorf("k3s-pinning: stopped: %v", err)
		}
		client.Close()
		result <- err
	}()
	return agent.Keeper(), result, nil
}
