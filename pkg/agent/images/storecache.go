package images

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	containerdlabels "github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// storeCache is the image store and the content store, each listed once when first asked:
// verifying that every reference of the images dir is present, complete and pinned then costs two
// calls to containerd, not one or more per reference (a warm restart of 10,000 references). It is
// a moment's view: what changes after it is seen by the events Run follows, and by the next sync.
// A sync makes one (listedStore), and archives imported side by side share it. A restore makes a
// lookupStore instead: it asks for one archive's references, and a list of the whole store per
// restored archive would make the disk-pressure path cost O(store) per archive.
type storeCache struct {
	mu     sync.Mutex
	lookup bool // a Get per reference and an Info per blob, no list
	// listed are the image records as listed or got (sorted by name), once, which the sync's
	// later passes take (take) rather than a copy; isListed: the store was listed.
	listed   imagelist.Records
	isListed bool
	content  *blobSet // nil until the content store is first walked
	// compressed are the blobs labelled as the compression of a layer, by the layer's digest:
	// what containerd's import of a docker archive looks for, collected in the same walk.
	compressed map[digest.Digest][]content.Info
	written    bool // a load wrote to the store after the snapshot was taken
	// lease holds what the loads of this sync or restore import until their references exist:
	// one for all of them, made at the first import and ended with the sync (endImports). A
	// lease is two of containerd's transactions, and a cold load waits on them.
	lease *leases.Lease
}

// importLease is the lease of the snapshot's imports, made at the first.
func (snap *storeCache) importLease(ctx context.Context, im *importer) (string, error) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	if snap.lease == nil {
		lease, err := im.cd.Leases.Create(ctx, leases.WithRandomID(), leases.WithExpiration(24*time.Hour), leases.WithLabels(im.leaseLabels))
		if err != nil {
			return "", err
		}
		snap.lease = &lease
	}
	return snap.lease.ID, nil
}

// endImports ends the lease of the snapshot's imports, once every load has created its references:
// what they imported and no reference holds is containerd's GC's.
func (snap *storeCache) endImports(ctx context.Context, im *importer) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	if snap.lease != nil {
		if err := im.cd.Leases.Delete(context.WithoutCancel(ctx), *snap.lease); err != nil && !errdefs.IsNotFound(err) {
			logrus.Warnf("import lease %s: %v (it expires in 24 hours)", snap.lease.ID, err)
		}
		snap.lease = nil
	}
}

// wrote records that the store no longer is what the snapshot says.
func (snap *storeCache) wrote() {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	snap.written = true
}

// listedStore is a sync's snapshot: each store listed once, when first asked.
func listedStore() *storeCache { return &storeCache{} }

// lookupStore is a restore's: each reference and blob asked for, and remembered.
func lookupStore() *storeCache {
	return &storeCache{lookup: true, content: newBlobSet()}
}

// image is the reference ref as the snapshot has it; the first call of a listed snapshot lists
// the image store.
func (im *importer) image(ctx context.Context, snap *storeCache, ref string) (images.Image, bool, error) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	if snap.lookup {
		if r, ok := snap.listed.Find(ref); ok {
			return r.Image(), true, nil
		}
		img, err := im.cd.Images.Get(ctx, ref)
		if errdefs.IsNotFound(err) {
			return images.Image{}, false, nil
		}
		if err != nil {
			return images.Image{}, false, fmt.Errorf("image %s: %w", ref, err)
		}
		snap.listed = snap.listed.Insert(imagelist.Record{Name: img.Name, Labels: img.Labels, Target: &img.Target})
		return img, true, nil
	}
	if err := im.listImages(ctx, snap); err != nil {
		return images.Image{}, false, err
	}
	if r, ok := snap.listed.Find(ref); ok {
		return r.Image(), true, nil
	}
	return images.Image{}, false, nil
}

// listImages lists the image store into a listed snapshot, unless it is listed; snap.mu is held.
func (im *importer) listImages(ctx context.Context, snap *storeCache) error {
	if snap.isListed {
		return nil
	}
	listed, err := imagelist.List(ctx, im.cd.Images)
	if err != nil {
		return fmt.Errorf("list images: %w", err)
	}
	snap.listed, snap.isListed = listed, true
	return nil
}

// listFirst lists the image store into a listed snapshot before the sync indexes the images dir,
// not at its first load: containerd's answer, which gRPC holds whole while it is decoded, and the
// decoding's garbage are then gone before the archives' indexes
// are made, rather than beside them at the sync's peak. A failure is the loads' to report: each
// lists again when it first asks. With only .txt lists in the dir (their pulls write through the
// CRI), the sync lists the store again after them: one list more than before this was moved.
func (im *importer) listFirst(ctx context.Context, snap *storeCache) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	im.listImages(ctx, snap)
}

// take is the image store as a listed snapshot listed it, false if it never listed the store or
// a load wrote to it since; either way the snapshot lets go of its lists, so that what the sync
// does next (a list of the store after its loads, the keep-set, the state) does not hold them too.
func (snap *storeCache) take() (imagelist.Records, bool) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	listed, ok := snap.listed, !snap.lookup && snap.isListed && !snap.written
	snap.listed, snap.isListed, snap.content, snap.compressed = nil, false, nil, nil
	if !ok {
		return nil, false
	}
	return listed, true
}

// hasContent says whether containerd holds the blob d; the first call of a listed snapshot lists
// the content store.
func (im *importer) hasContent(ctx context.Context, snap *storeCache, d digest.Digest) (bool, error) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	if snap.lookup {
		if has, ok := snap.content.get(d); ok {
			return has, nil
		}
		_, err := im.cd.Content.Info(ctx, d)
		if err != nil && !errdefs.IsNotFound(err) {
			return false, fmt.Errorf("content %s: %w", d, err)
		}
		snap.content.set(d, err == nil)
		return err == nil, nil
	}
	if err := im.walkContent(ctx, snap); err != nil {
		return false, err
	}
	has, _ := snap.content.get(d)
	return has, nil
}

// walkContent lists the content store into a listed snapshot, once; snap.mu is held.
func (im *importer) walkContent(ctx context.Context, snap *storeCache) error {
	if snap.content != nil {
		return nil
	}
	all, compressed := newBlobSet(), map[digest.Digest][]content.Info{}
	if err := im.cd.Content.Walk(ctx, func(info content.Info) error {
		all.set(info.Digest, true)
		if u, err := digest.Parse(info.Labels[containerdlabels.LabelUncompressed]); err == nil {
			compressed[u] = append(compressed[u], info)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("list content: %w", err)
	}
	snap.content, snap.compressed = all, compressed
	return nil
}

// blobSet says, by digest, whether containerd holds a blob. A sha256 digest is kept as its 32
// bytes, not its string as containerd's answer decoded it (twice the size): a sync holds a
// large store's walk through all its loads.
type blobSet struct {
	sha256 map[[sha256.Size]byte]bool
	other  map[digest.Digest]bool // any other digest, as it is
}

func newBlobSet() *blobSet {
	return &blobSet{sha256: map[[sha256.Size]byte]bool{}, other: map[digest.Digest]bool{}}
}

// sha256Key is d's 32 bytes, when d is a well-formed sha256 digest.
func sha256Key(d digest.Digest) (k [sha256.Size]byte, ok bool) {
	if d.Algorithm() != digest.SHA256 || len(d.Encoded()) != 2*sha256.Size {
		return k, false
	}
	_, err := hex.Decode(k[:], []byte(d.Encoded()))
	return k, err == nil
}

// get is what s knows of d: whether the blob is held, and whether s knows.
func (s *blobSet) get(d digest.Digest) (has, known bool) {
	if k, ok := sha256Key(d); ok {
		has, known = s.sha256[k]
	} else {
		has, known = s.other[d]
	}
	return has, known
}

// set records whether the blob d is held.
func (s *blobSet) set(d digest.Digest, has bool) {
	if k, ok := sha256Key(d); ok {
		s.sha256[k] = has
	} else {
		s.other[d] = has
	}
}

// presentTargets returns the images of idx as they are in containerd (as snap lists them), and
// whether all of them are there, complete for the node's platform, with the content the archive
// holds (same manifest digest, or for docker archives, whose manifest containerd writes at import,
// the same config). Only what containerd says is not found counts as absent: any other error
// (containerd restarting, a timeout) is returned, and never causes a re-import.
func (im *importer) presentTargets(ctx context.Context, idx *airgap.Index, snap *storeCache) ([]images.Image, bool, error) {
	var found []images.Image
	for _, want := range idx.Images {
		img, ok, err := im.image(ctx, snap, want.Ref)
		if err != nil {
			return nil, false, err
		}
		if !ok {
			return nil, false, nil
		}
		if want.Digest != "" && img.Target.Digest != want.Digest {
			return nil, false, nil
		}
		if want.Digest == "" && !im.imageIDNames(ctx, snap, want.ImageID, img.Target.Digest) {
			config, err := img.Config(ctx, im.cd.Content, platforms.Default())
			if errdefs.IsNotFound(err) || (err == nil && config.Digest != want.ImageID) {
				return nil, false, nil
			}
			if err != nil {
				return nil, false, err
			}
		}
		// The reference alone is not the image: content deleted under it (the CRI's RemoveImage
		// racing a restore, then containerd's GC) leaves a name the CRI cannot resolve. The
		// target blob is enough to ask for: containerd's GC keeps a referenced manifest's
		// children, and import checked them (complete) when the reference was made.
		if has, err := im.hasContent(ctx, snap, img.Target.Digest); err != nil {
			return nil, false, err
		} else if !has {
			return nil, false, nil
		}
		// Named by the index's string, not the list's (equal): what the sync keeps of this
		// reference (its record in the state, the plan) does not hold the decoded list's copy.
		img.Name = want.Ref
		found = append(found, img)
	}
	return found, true, nil
}

// imageID is the image ID (config digest for the node's platform) idx gives ref, "" if none.
func imageID(idx *airgap.Index, ref string) digest.Digest {
	for _, want := range idx.Images {
		if want.Ref == ref {
			return want.ImageID
		}
	}
	return ""
}

// putImageID makes the CRI's image ID record of an image the agent names (sha256:<id>, marked
// as the CRI marks it), unless the store has it, and says whether it is there. The image's new
// names are then made with the CRI's mark (pinning.Managed): the CRI updates a name made without
// it, making this record and then writing the mark, and at a cold load those were 2 of every 11
// transactions of an image (of 3 small blobs) that the load waited on. A record on another
// target (another manifest of the same config) is pointed at this one, as the CRI does.
func (im *importer) putImageID(ctx context.Context, snap *storeCache, id digest.Digest, target ocispec.Descriptor) bool {
	if id == "" {
		return false
	}
	existing, ok, err := im.image(ctx, snap, id.String())
	switch {
	case err != nil:
		return false
	case ok && existing.Target.Digest == target.Digest:
		return true
	case ok:
		_, err = im.cd.Images.Update(ctx, images.Image{Name: id.String(), Target: target}, "target")
	default:
		_, err = im.cd.Images.Create(ctx, images.Image{Name: id.String(), Target: target, Labels: map[string]string{pinning.LabelCRIManaged: pinning.CRIManagedValue}})
		if errdefs.IsAlreadyExists(err) { // made since the snapshot, for this image or one of its config
			err = nil
		}
	}
	if err != nil {
		logrus.Warnf("image ID record %s: %v (the CRI makes it)", id, err)
		return false
	}
	snap.wrote()
	return true
}

// imageIDNames says whether the store's record of the image ID id (the CRI's sha256:<config
// digest>, beside every image it knows) points at target: the CRI made it from target's config,
// which is then id, and the manifest need not be read to know it (10,000 reads of a manifest, a
// quarter of what a first sync at 10,000 references allocated). False when there is no such
// record: the caller reads the config.
func (im *importer) imageIDNames(ctx context.Context, snap *storeCache, id, target digest.Digest) bool {
	if id == "" {
		return false
	}
	img, ok, err := im.image(ctx, snap, id.String())
	return err == nil && ok && img.Target.Digest == target
}
