package images

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// K3sConfig is what a patched k3s passes from its agent configuration (config.Node).
type K3sConfig struct {
	Address         string   // cfg.Containerd.Address
	ImagesDir       string   // cfg.Images
	ExtraRegistries []string // cfg.AgentConfig.AirgapExtraRegistry
	// StateFile defaults to k3s-pinning/state.json beside the images dir (agent/), outside it.
	StateFile string
}

// StartK3s takes over the images dir for k3s, in place of its PreloadImages import and watcher.
// Like PreloadImages it returns once what the images dir holds is imported (and pinned, from the
// moment each reference is created); it then keeps everything wanted present and pinned until ctx
// ends: re-pin, restore from the archive, follow the dir. k3s's own pins (io.cattle.k3s.pinned)
// are adopted rather than cleared, so a restart never leaves an image unpinned: a pinned image
// the images dir still provides becomes ours without its CRI pin being touched, and the pin of one
// it no longer provides is cleared, as k3s does at start. The Keeper is the kubelet image GC
// filter's keep-decision; register it before the kubelet starts. stopped is closed once the agent
// has stopped after ctx ended.
//
// On Windows it returns an error that matches errors.ErrUnsupported, before touching anything: the
// package builds there (k3s builds Windows agents), but it has not been run on a Windows node, so
// the patched k3s leaves agent/images to its own import.
func StartK3s(ctx context.Context, cfg K3sConfig, opts *K3sOptions) (keeper *Keeper, stopped <-chan struct{}, err error) {
	if runtime.GOOS == "windows" {
		return nil, nil, fmt.Errorf("k3s-pinning: not supported on windows: %w", errors.ErrUnsupported)
	}
	if !opts.Enabled() {
		return nil, nil, fmt.Errorf("k3s-pinning: --disable-image-pinning is set; k3s imports the images dir itself")
	}
	policy, err := opts.Validate()
	if err != nil {
		return nil, nil, err
	}
	if cfg.StateFile == "" {
		cfg.StateFile = filepath.Join(filepath.Dir(cfg.ImagesDir), "k3s-pinning", "state.json")
	}
	client, err := containerd.New(cfg.Address, containerd.WithTimeout(10*time.Second))
	if err != nil {
		return nil, nil, fmt.Errorf("k3s-pinning: containerd at %s: %w", cfg.Address, err)
	}
	ctx = namespaces.WithNamespace(ctx, pinning.DefaultNamespace)
	agent := NewAgent(client, Config{ImagesDir: cfg.ImagesDir, Policy: policy, ExtraRegistries: cfg.ExtraRegistries, StateFile: cfg.StateFile})
	start := time.Now()
	report := agent.Sync(ctx)
	if err := report.Err(); err != nil {
		logrus.Errorf("k3s-pinning: not every file of %s was loaded (the others were): %v", cfg.ImagesDir, err)
	}
	if err := agent.adoptK3sPins(ctx); err != nil {
		logrus.Errorf("k3s-pinning: %v", err)
	}
	logrus.Infof("k3s-pinning: %s loaded and pinned in %s; following it", cfg.ImagesDir, time.Since(start).Round(time.Millisecond))
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer client.Close()
		agent.Run(ctx, RunOptions{Restore: !opts.DisableImageRestore, Synced: true})
	}()
	return agent.Keeper(), done, nil
}

// adoptK3sPins, right after a sync, takes over the pins stock k3s set (LabelK3sPinned beside the CRI pin). k3s clears
// them at every start and imports again, which leaves its images unpinned meanwhile (k3s issue
// 14265); here a wanted image keeps its CRI pin and gets ours, and only the pin of an image
// nothing wants any more is cleared, as k3s would.
func (a *Agent) adoptK3sPins(ctx context.Context) error {
	store := a.client.ImageService()
	marked, err := store.List(ctx, fmt.Sprintf("labels.%q==%s", pinning.LabelK3sPinned, pinning.PinnedValue))
	if err != nil || len(marked) == 0 {
		return err
	}
	if a.wanted == nil {
		// the sync could not list containerd: k3s's pins stay as they are until the next start
		return errors.New("k3s's pins left as they are: the start-up sync could not list containerd")
	}
	var errs []error
	for _, img := range marked {
		fields := []string{"labels." + pinning.LabelK3sPinned}
		delete(img.Labels, pinning.LabelK3sPinned)
		src, wanted := a.wanted.source(img)
		_, ours := pinning.OwnPin(img.Labels)
		var did string
		switch {
		case ours:
			did = "dropped k3s's mark beside our pin"
		case wanted:
			img.Labels[pinning.LabelPinned], img.Labels[pinning.LabelSource] = pinning.PinnedValue, src
			fields = append(fields, "labels."+pinning.LabelPinned, "labels."+pinning.LabelSource)
			did = fmt.Sprintf("k3s's pin is now ours (%s wants it); it was never unpinned", src)
		default:
			delete(img.Labels, pinning.LabelPinned)
			fields = append(fields, "labels."+pinning.LabelPinned)
			did = "cleared k3s's pin: nothing in the images dir provides it any more"
		}
		if _, err := store.Update(ctx, img, fields...); err != nil {
			errs = append(errs, fmt.Errorf("adopt k3s's pin on %s: %w", img.Name, err))
			continue
		}
		logrus.Infof("k3s-pinning: %s: %s", img.Name, did)
	}
	return errors.Join(errs...)
}
