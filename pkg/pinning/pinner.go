package pinning

import (
	"context"
	"errors"
	"fmt"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/errdefs"
)

// ErrNotOurs is returned when asked to remove a pin that k3s-pinning did not set.
var ErrNotOurs = errors.New("pin was not set by k3s-pinning")

// PinResult says what Pin found and did.
type PinResult int

const (
	// Pinned: the pin was missing and we set it.
	Pinned PinResult = iota
	// AlreadyOurs: our pin was already there; nothing was written.
	AlreadyOurs
	// PinnedByOther: a pin we did not set is there (a user's, k3s's); left as it is, not recorded
	// as ours, so that unpinning later never removes it.
	PinnedByOther
)

func (r PinResult) String() string {
	return [...]string{"pinned", "already pinned", "pinned by another owner"}[r]
}

// Pinner sets and removes pins on references in a containerd image store. The namespace is
// carried in the context, as everywhere in the containerd client.
type Pinner struct {
	store images.Store
}

// NewPinner returns a Pinner over store (client.ImageService()).
func NewPinner(store images.Store) *Pinner { return &Pinner{store: store} }

// Pin pins the reference name for source. Only the two pin labels are written; every other label
// of the image stays as it is.
func (p *Pinner) Pin(ctx context.Context, name, source string) (PinResult, error) {
	img, err := p.store.Get(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("pin %s: %w", name, err)
	}
	return p.pinImage(ctx, img, source)
}

func (p *Pinner) pinImage(ctx context.Context, img images.Image, source string) (PinResult, error) {
	if _, ours := OwnPin(img.Labels); ours {
		return AlreadyOurs, nil
	}
	if IsPinned(img.Labels) {
		return PinnedByOther, nil
	}
	update := images.Image{Name: img.Name, Labels: PinLabels(source)}
	if _, err := p.store.Update(ctx, update, "labels."+LabelPinned, "labels."+LabelSource); err != nil {
		return 0, fmt.Errorf("pin %s: %w", img.Name, err)
	}
	return Pinned, nil
}

// Unpin removes our pin from the reference name. It refuses, with ErrNotOurs, to touch a pin we
// did not set. A reference that is gone has nothing to unpin and is not an error.
func (p *Pinner) Unpin(ctx context.Context, name string) error {
	img, err := p.store.Get(ctx, name)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("unpin %s: %w", name, err)
	}
	if _, ours := OwnPin(img.Labels); !ours {
		if IsPinned(img.Labels) {
			return fmt.Errorf("unpin %s: %w", name, ErrNotOurs)
		}
		return nil
	}
	// Naming a label in the field paths while leaving it out of Labels deletes it.
	update := images.Image{Name: img.Name}
	if _, err := p.store.Update(ctx, update, "labels."+LabelPinned, "labels."+LabelSource); err != nil {
		return fmt.Errorf("unpin %s: %w", name, err)
	}
	return nil
}

// Transfer records to as the owner of our pin on name, when from owns it now: the pin stays, only
// who wants it changes (an archive left, another still provides the image).
func (p *Pinner) Transfer(ctx context.Context, name, from, to string) error {
	img, err := p.store.Get(ctx, name)
	if err != nil {
		return fmt.Errorf("transfer %s: %w", name, err)
	}
	if src, ours := OwnPin(img.Labels); !ours || src != from {
		return fmt.Errorf("transfer %s: pin is not %s's", name, from)
	}
	update := images.Image{Name: name, Labels: map[string]string{LabelSource: to}}
	if _, err := p.store.Update(ctx, update, "labels."+LabelSource); err != nil {
		return fmt.Errorf("transfer %s: %w", name, err)
	}
	return nil
}

// PinPolicy pins every image of all (the store's list, which the caller has made) that policy
// wants and that is not pinned yet, and returns the references it pinned. An error on one
// reference does not stop the others.
func (p *Pinner) PinPolicy(ctx context.Context, policy *Policy, all []images.Image) (pinned []string, err error) {
	if policy.Empty() {
		return nil, nil
	}
	var errs []error
	for _, img := range all {
		if !policy.Wants(img) {
			continue
		}
		res, err := p.pinImage(ctx, img, SourcePolicy)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if res == Pinned {
			pinned = append(pinned, img.Name)
		}
	}
	return pinned, errors.Join(errs...)
}
