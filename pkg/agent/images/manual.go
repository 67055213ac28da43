package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/errdefs"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// PinManual pins ref by hand (`k3s-pinning pin`), recorded as SourceManual.
func (a *Agent) PinManual(ctx context.Context, ref string) (pinning.PinResult, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	img, err := a.existing(ctx, ref)
	if err != nil {
		return 0, err
	}
	return a.pinner.PinImage(ctx, img, pinning.SourceManual)
}

// UnpinManual removes our pin from ref (`k3s-pinning unpin`). It never removes a pin we did not
// set. wantedBy names what still wants ref kept, so the caller can say that sync will pin it again.
func (a *Agent) UnpinManual(ctx context.Context, ref string) (wantedBy string, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	img, err := a.existing(ctx, ref)
	if err != nil {
		return "", err
	}
	// A retained archive's image is kept until it is unpinned: every name the archive gave it
	// goes with the one named, so that nothing pins it again. The file is read again, changed and
	// written in one turn of its lock: the running agent may have retained more since this process
	// started, and a save of its own between the read and the write would be lost.
	var dropped []string
	unpin := func() error {
		if err := a.pinner.Unpin(ctx, img.Name); err != nil {
			return err
		}
		dropped = a.dropRetained(img.Name)
		return nil
	}
	if a.cfg.StateFile == "" {
		err = unpin()
	} else {
		err = statefile.WithLock(a.cfg.StateFile, func() error {
			fresh, err := statefile.Load(a.cfg.StateFile)
			if err != nil {
				// Which names a retained archive gave the image is in the file alone: without
				// them the running agent would pin the others again, and this process must not
				// write a file it could not read.
				if src := a.retainedCandidate(img); src != "" {
					return fmt.Errorf("unpin %s: pinned for %s, which is not in the images dir, and what it retained cannot be read (%w): run `k3s-pinning sync` (or wait for the running agent's next reconcile), which writes the state again, then unpin again", img.Name, src, err)
				}
				return a.pinner.Unpin(ctx, img.Name)
			}
			a.state.Retained = fresh.Retained
			a.noteRetained()
			if err := unpin(); err != nil || len(dropped) == 0 {
				return err
			}
			return fresh.WriteLocked(a.cfg.StateFile)
		})
	}
	if err != nil {
		return "", err
	}
	for _, name := range dropped {
		if name == img.Name {
			continue
		}
		if err := a.pinner.Unpin(ctx, name); err != nil && !errdefs.IsNotFound(err) && !errors.Is(err, pinning.ErrNotOurs) {
			return "", err
		}
		logrus.Infof("unpinned %s too: a removed archive retained it with %s", name, img.Name)
	}
	sv := a.survey()
	return a.newPlan(sv.present, sv.read).Heir(img, pinning.SourceManual), nil
}

// retainedCandidate is the archive our pin on img names when that archive is not in the images
// dir: the image may be one it retained.
func (a *Agent) retainedCandidate(img images.Image) string {
	src, ours := pinning.OwnPin(img.Labels)
	if !ours || !pinning.IsArchiveSource(src) {
		return ""
	}
	if _, err := os.Stat(filepath.Join(a.cfg.ImagesDir, src)); err == nil {
		return ""
	}
	return src
}

// reloadRetained applies what `k3s-pinning unpin`, run as another process beside this agent,
// dropped from the retained archives in the state file since this agent last read or wrote it: a
// reference this agent saw there and the file no longer holds is dropped; what it retained since
// stays. Only when this agent's last save succeeded: otherwise the file is older than its memory.
func (a *Agent) reloadRetained() {
	// Nothing retained here, nothing another process could have dropped: no read of the file
	// (the start-up sync and every save of a node that never retained anything).
	if a.cfg.StateFile == "" || a.state.Agent.StateError != "" || len(a.state.Retained) == 0 {
		return
	}
	s, err := statefile.Load(a.cfg.StateFile)
	if err != nil {
		return
	}
	for name, rec := range a.state.Retained {
		onFile := s.Retained[name]
		for ref := range rec.Refs {
			if a.retainedSeen[name][ref] && (onFile == nil || onFile.Refs[ref] == "") {
				delete(rec.Refs, ref)
			}
		}
		rec.Images = slices.DeleteFunc(rec.Images, func(img airgap.IndexedImage) bool { _, kept := rec.Refs[img.Ref]; return !kept })
		if len(rec.Refs) == 0 {
			delete(a.state.Retained, name)
		}
	}
	a.noteRetained()
}

// noteRetained records the retained references as the state file has them now.
func (a *Agent) noteRetained() {
	a.retainedSeen = map[string]map[string]bool{}
	for name, rec := range a.state.Retained {
		a.retainedSeen[name] = map[string]bool{}
		for ref := range rec.Refs {
			a.retainedSeen[name][ref] = true
		}
	}
}

// dropRetained removes ref, and every other name a retained archive recorded for the same image,
// from the retained archives (an archive left with nothing is forgotten). It returns the names
// dropped; the caller saves.
func (a *Agent) dropRetained(ref string) []string {
	var dropped []string
	for _, name := range slices.Sorted(maps.Keys(a.state.Retained)) {
		rec := a.state.Retained[name]
		d, ok := rec.Refs[ref]
		if !ok {
			continue
		}
		for r, rd := range rec.Refs {
			if rd == d {
				delete(rec.Refs, r)
				dropped = append(dropped, r)
			}
		}
		rec.Images = slices.DeleteFunc(rec.Images, func(img airgap.IndexedImage) bool { _, kept := rec.Refs[img.Ref]; return !kept })
		if len(rec.Refs) == 0 {
			delete(a.state.Retained, name)
			logrus.Infof("%s: nothing retained any more; forgotten", name)
		}
	}
	return dropped
}

// existing is the image ref names, as given or in its normalized form (nginx:1 is
// docker.io/library/nginx:1).
func (a *Agent) existing(ctx context.Context, ref string) (images.Image, error) {
	img, err := a.cd.Images.Get(ctx, ref)
	if errdefs.IsNotFound(err) {
		if n := normalize(ref); n != ref {
			img, err = a.cd.Images.Get(ctx, n)
		}
	}
	if errdefs.IsNotFound(err) {
		return images.Image{}, fmt.Errorf("image %s: not found in containerd", ref)
	}
	if err != nil {
		return images.Image{}, fmt.Errorf("image %s: %w", ref, err)
	}
	return img, nil
}
