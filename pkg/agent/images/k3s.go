package images

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// K3sConfig is what a patched k3s passes: from its agent configuration (config.Node) and the
// values of the k3s-pinning flags (K3sFlags), all plain values.
type K3sConfig struct {
	Address         string   // cfg.Containerd.Address
	ImagesDir       string   // cfg.Images
	ExtraRegistries []string // cfg.AgentConfig.AirgapExtraRegistry
	// StateFile defaults to k3s-pinning/state.json beside the images dir (agent/), outside it.
	StateFile string
	// Reporter, when set, is told the agent's events and the node's protection (a cluster.Node
	// on the agent's kubelet kubeconfig, which the caller runs).
	Reporter Reporter
	// WatchWorkloads follows the images the cluster's workloads reference, for
	// --pinned-workload-images (cluster.Node.WatchWorkloads).
	WatchWorkloads WorkloadWatcher
	K3sSettings
}

// StartK3s takes over the images dir for k3s, in place of its PreloadImages import and watcher.
// Like PreloadImages it returns once what the images dir holds is imported (and pinned, from the
// moment each reference is created); it then keeps everything wanted present and pinned until ctx
// ends: re-pin, restore from the archive, follow the dir. k3s's own pins (io.cattle.k3s.pinned)
// are adopted rather than cleared, so a restart never leaves an image unpinned: a pinned image
// the images dir still provides becomes ours without its CRI pin being touched, and the pin of one
// it no longer provides is cleared, as k3s does at start. The Keeper is the kubelet image GC
// filter's keep-decision; register it before the kubelet starts. done yields Run's result once
// the agent has stopped after ctx ended, every goroutine ended and the connection closed.
//
// On Windows it returns an error that matches errors.ErrUnsupported, before touching anything: the
// package builds there (k3s builds Windows agents), but it has not been run on a Windows node, so
// the patched k3s leaves agent/images to its own import.
func StartK3s(ctx context.Context, cfg K3sConfig) (keeper *Keeper, done <-chan error, err error) {
	if runtime.GOOS == "windows" {
		return nil, nil, fmt.Errorf("k3s-pinning: not supported on windows: %w", errors.ErrUnsupported)
	}
	if cfg.DisableImagePinning {
		return nil, nil, fmt.Errorf("k3s-pinning: --%s is set; k3s imports the images dir itself", FlagDisableImagePinning)
	}
	policy, err := cfg.Policy()
	if err != nil {
		return nil, nil, fmt.Errorf("k3s-pinning: %w", err)
	}
	if cfg.StateFile == "" {
		cfg.StateFile = filepath.Join(filepath.Dir(cfg.ImagesDir), "k3s-pinning", "state.json")
	}
	client, err := Connect(cfg.Address)
	if err != nil {
		return nil, nil, fmt.Errorf("k3s-pinning: containerd at %s: %w", cfg.Address, err)
	}
	ctx = namespaces.WithNamespace(ctx, pinning.DefaultNamespace)
	agent := NewAgent(Services(client), cfg.PolicyValues.AgentConfig(Config{ImagesDir: cfg.ImagesDir, Policy: policy, ExtraRegistries: cfg.ExtraRegistries, StateFile: cfg.StateFile, Reporter: cfg.Reporter}))
	start := time.Now()
	report := agent.Sync(ctx)
	if err := report.Err(); err != nil {
		logrus.Errorf("k3s-pinning: not every file of %s was loaded (the others were): %v", cfg.ImagesDir, err)
	}
	if err := agent.adoptK3sPins(ctx); err != nil {
		logrus.Errorf("k3s-pinning: %v", err)
	}
	logrus.Infof("k3s-pinning: %s loaded and pinned in %s; following it", cfg.ImagesDir, time.Since(start).Round(time.Millisecond))
	if w, ok := cfg.Reporter.(ReconcileWatcher); ok {
		w.WatchReconciles(agent.Reconciled, StalledIntervals*DefaultReconcileInterval)
	}
	if cfg.PinnedWorkloadImages {
		if cfg.WatchWorkloads == nil {
			logrus.Errorf("k3s-pinning: --%s: no connection to the cluster was given; keeping the images dir and the policy only", FlagPinnedWorkloadImages)
		} else {
			go cfg.WatchWorkloads(ctx, cfg.WorkloadScope(), agent.SetWorkloadImages)
		}
	}
	result := make(chan error, 1)
	go func() {
		err := agent.Run(ctx, RunOptions{Restore: !cfg.DisableImageRestore, Synced: true})
		if err != nil {
			logrus.Errorf("k3s-pinning: stopped: %v", err)
		}
		client.Close()
		result <- err
	}()
	return agent.Keeper(), result, nil
}

// adoptK3sPins, right after a sync, takes over the pins stock k3s set (LabelK3sPinned beside the
// CRI pin), each as the plan says: ours for what it wants, cleared for the rest (pinning.Adopt).
func (a *Agent) adoptK3sPins(ctx context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	marked, err := a.cd.Images.List(ctx, fmt.Sprintf("%s==%s", pinning.LabelField(strconv.Quote(pinning.LabelK3sPinned)), pinning.PinnedValue))
	if err != nil || len(marked) == 0 {
		return err
	}
	if !a.listed {
		// the sync could not list containerd: k3s's pins stay as they are until the next start
		return errors.New("k3s's pins left as they are: the start-up sync could not list containerd")
	}
	var errs []error
	var adopted []string
	defer func() {
		if len(adopted) > 0 {
			a.event(false, ReasonPinsAdopted, "took over %d pin(s) stock k3s set, which it would drop at its next start: %s", len(adopted), firstFew(adopted))
		}
	}()
	for _, img := range marked {
		source, _ := a.plan.Source(img)
		did, err := a.pinner.Adopt(ctx, img, source)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		switch did {
		case pinning.KeptOurs:
			logrus.Infof("k3s-pinning: %s: dropped k3s's mark beside our pin", img.Name)
		case pinning.MadeOurs:
			adopted = append(adopted, img.Name)
			logrus.Infof("k3s-pinning: %s: k3s's pin is now ours (%s wants it); it was never unpinned", img.Name, source)
		case pinning.Cleared:
			logrus.Infof("k3s-pinning: %s: cleared k3s's pin: nothing in the images dir provides it any more", img.Name)
		}
	}
	return errors.Join(errs...)
}
