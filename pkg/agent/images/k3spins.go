package images

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// AdoptK3sPins, right after the first sync, takes over the pins stock k3s set (LabelK3sPinned beside the
// CRI pin), each as the plan says: ours for what it wants, cleared for the rest (pinning.Adopt).
func (a *Agent) AdoptK3sPins(ctx context.Context) error {
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
