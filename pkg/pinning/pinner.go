package pinning

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"slices"
	"strings"
	"sync"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
)

// ErrNotOurs is returned when asked to remove a pin that k3s-pinning did not set.
var ErrNotOurs = errors.New("pin was not set by k3s-pinning")

// PinResult says what a pin write found and did.
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
	switch r {
	case Pinned:
		return "pinned"
	case AlreadyOurs:
		return "already pinned"
	case PinnedByOther:
		return "pinned by another owner"
	}
	return fmt.Sprintf("PinResult(%d)", int(r))
}

// resultOf is what a pin write does to a reference whose pin is owner's.
func resultOf(owner Owner) PinResult {
	switch owner {
	case OurPin:
		return AlreadyOurs
	case TheirPin:
		return PinnedByOther
	}
	return Pinned
}

// Pinner is the one writer of pins: set at creation (Put), pin, unpin, transfer and adopt all go
// through it, so that the promise "never remove a pin we did not set" is kept in one place. It
// writes only the pin labels; every other label of an image stays as it is. The namespace is
// carried in the context, as everywhere in the containerd client.
type Pinner struct {
	store images.Store
}

// NewPinner returns a Pinner over store (client.ImageService(), or any images.Store).
func NewPinner(store images.Store) *Pinner { return &Pinner{store: store} }

// Pin pins the reference name for source.
func (p *Pinner) Pin(ctx context.Context, name, source string) (PinResult, error) {
	img, err := p.store.Get(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("pin %s: %w", name, err)
	}
	return p.PinImage(ctx, img, source)
}

// PinImage pins img, as listed a moment ago, for source.
func (p *Pinner) PinImage(ctx context.Context, img images.Image, source string) (PinResult, error) {
	res := resultOf(OwnerOf(img.Labels))
	if res != Pinned {
		return res, nil
	}
	update := images.Image{Name: img.Name, Labels: PinLabels(source)}
	if _, err := p.store.Update(ctx, update, pinFields...); err != nil {
		return 0, fmt.Errorf("pin %s: %w", img.Name, err)
	}
	return Pinned, nil
}

// PutOpt is an option of Put.
type PutOpt func(*putOptions)

type putOptions struct {
	listed  *images.Image
	managed bool
}

// Managed creates a new reference with the CRI's mark beside the pin (LabelCRIManaged), as the
// CRI would label it: the CRI then leaves it as it is, where it updates a name created without
// it (a transaction per name, which a cold load waits on). The caller has made the image's ID
// record, which the CRI then does not make.
func Managed() PutOpt {
	return func(o *putOptions) { o.managed = true }
}

// WithListed gives Put the reference as a list of the store showed it a moment ago. When it
// already points at the target and is pinned (ours, or someone else's: left theirs), Put makes no
// call at all: a warm restart verifies every reference of the images dir from one list of the store.
func WithListed(existing images.Image) PutOpt {
	return func(o *putOptions) { o.listed = &existing }
}

// Put makes the reference img.Name point at img.Target, pinned for source. A new reference is
// created with the pin labels, so it never exists unpinned. On an existing one only the target
// and the two pin labels are written, and a pin someone else set is left theirs.
func (p *Pinner) Put(ctx context.Context, img images.Image, source string, opts ...PutOpt) (PinResult, error) {
	var o putOptions
	for _, opt := range opts {
		opt(&o)
	}
	if l := o.listed; l != nil && l.Name == img.Name && Settled(*l, img.Target) {
		return resultOf(OwnerOf(l.Labels)), nil // what the write below would find, with no write
	}
	img.Labels = PinLabels(source)
	if o.managed {
		img.Labels[LabelCRIManaged] = CRIManagedValue
	}
	for range 3 {
		_, err := p.store.Create(ctx, img)
		if err == nil {
			return Pinned, nil
		}
		if !errdefs.IsAlreadyExists(err) {
			return 0, fmt.Errorf("create %s: %w", img.Name, err)
		}
		existing, err := p.store.Get(ctx, img.Name)
		if errdefs.IsNotFound(err) {
			continue // deleted in between: create again
		}
		if err != nil {
			return 0, fmt.Errorf("get %s: %w", img.Name, err)
		}
		var fields []string
		if existing.Target.Digest != img.Target.Digest {
			fields = append(fields, "target")
		}
		res := resultOf(OwnerOf(existing.Labels))
		if res == Pinned {
			fields = append(fields, pinFields...)
		}
		if len(fields) == 0 {
			return res, nil
		}
		if _, err := p.store.Update(ctx, img, fields...); errdefs.IsNotFound(err) {
			continue
		} else if err != nil {
			return 0, fmt.Errorf("update %s: %w", img.Name, err)
		}
		return res, nil
	}
	return 0, fmt.Errorf("put %s: reference kept disappearing", img.Name)
}

// Settled says whether listed, as a list of the store showed it, is already what Put would make
// of it for target: the same target, pinned by anyone. Put with WithListed writes nothing then.
func Settled(listed images.Image, target ocispec.Descriptor) bool {
	return listed.Target.Digest == target.Digest && OwnerOf(listed.Labels) != NoPin
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
	switch OwnerOf(img.Labels) {
	case TheirPin:
		return fmt.Errorf("unpin %s: %w", name, ErrNotOurs)
	case NoPin:
		return nil
	}
	// Naming a label in the field paths while leaving it out of Labels deletes it.
	if _, err := p.store.Update(ctx, images.Image{Name: img.Name}, pinFields...); err != nil {
		return fmt.Errorf("unpin %s: %w", name, err)
	}
	return nil
}

// Release gives up source's pin on name: it passes to heir (another archive that provides the
// image, or the policy) or, with no heir, is removed. A pin that is not source's is not touched.
// released says whether anything was written.
func (p *Pinner) Release(ctx context.Context, name, source, heir string) (released bool, err error) {
	img, err := p.store.Get(ctx, name)
	if errdefs.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("release %s: %w", name, err)
	}
	if src, ours := OwnPin(img.Labels); !ours || src != source {
		return false, nil
	}
	if heir == "" {
		return true, p.Unpin(ctx, name)
	}
	update := images.Image{Name: name, Labels: map[string]string{LabelSource: heir}}
	if _, err := p.store.Update(ctx, update, LabelField(LabelSource)); err != nil {
		return false, fmt.Errorf("release %s to %s: %w", name, heir, err)
	}
	return true, nil
}

// Adoption is what Adopt did with a pin k3s set.
type Adoption int

const (
	// KeptOurs: our pin was there beside k3s's mark; only the mark was dropped.
	KeptOurs Adoption = iota
	// MadeOurs: k3s's pin became ours without the CRI pin ever being removed.
	MadeOurs
	// Cleared: nothing wants the image any more; k3s's pin was cleared, as k3s does at start.
	Cleared
)

// Adopt takes over the pin stock k3s set on img (LabelK3sPinned beside the CRI pin). k3s clears
// its pins at every start and imports again, which leaves its images unpinned meanwhile (k3s
// issue 14265): a wanted image (source non-empty) keeps its CRI pin and gets ours; the pin of one
// nothing wants is cleared, as k3s would.
func (p *Pinner) Adopt(ctx context.Context, img images.Image, source string) (Adoption, error) {
	labels := map[string]string{}
	fields := []string{LabelField(LabelK3sPinned)}
	did := KeptOurs
	switch {
	case OwnerOf(img.Labels) == OurPin:
	case source != "":
		labels, did = PinLabels(source), MadeOurs
		fields = append(fields, pinFields...)
	default:
		did = Cleared
		fields = append(fields, LabelField(LabelPinned))
	}
	if _, err := p.store.Update(ctx, images.Image{Name: img.Name, Labels: labels}, fields...); err != nil {
		return 0, fmt.Errorf("adopt k3s's pin on %s: %w", img.Name, err)
	}
	return did, nil
}

// pinWorkers is how many pin writes PinWanted keeps in flight. containerd commits each write in a
// transaction of its own, one at a time; a few in flight keep it from waiting on the next request.
const pinWorkers = 8

// PinWanted pins every image of all (the store's list, which the caller has made) that wants
// names a source for and that is not pinned yet, and returns them with the source each was pinned
// for. The writes go pinWorkers at a time; an error on one reference does not stop the others.
func (p *Pinner) PinWanted(ctx context.Context, all iter.Seq[images.Image], wants func(images.Image) (string, bool)) (pinned map[string]string, err error) {
	var (
		mu   sync.Mutex
		errs []error
		g    errgroup.Group
	)
	g.SetLimit(pinWorkers)
	for img := range all {
		source, ok := wants(img)
		if !ok || OwnerOf(img.Labels) != NoPin {
			continue
		}
		g.Go(func() error {
			_, err := p.PinImage(ctx, img, source)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return nil
			}
			if pinned == nil {
				pinned = map[string]string{}
			}
			pinned[img.Name] = source
			return nil
		})
	}
	g.Wait()
	slices.SortFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) }) // the same report for the same failures
	return pinned, errors.Join(errs...)
}
