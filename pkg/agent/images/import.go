package images

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/containerd/v2/core/leases"
	containerdlabels "github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/sirupsen/logrus"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// importer puts what an archive provides into containerd, each reference pinned from the moment
// it is created. The namespace is carried in the context.
type importer struct {
	cd     Containerd
	pinner *pinning.Pinner
	// extraRegistries are the --airgap-extra-registry values: every imported tag is also created
	// under each of these registries, as k3s does.
	extraRegistries []string
	leaseLabels     map[string]string // of each import lease: set while the agent owns its state file (ownImportLeases)
	// pullLater, while Run runs, takes a list entry to pull in the background (listPulls.later);
	// nil: entries are pulled in place, each within listPullTimeout.
	pullLater func(ref string) error
}

// errPullPending is the result of a list entry handed to the background: not an error of the
// list (it is not reported as one), but not loaded yet either.
var errPullPending = errors.New("being pulled in the background")

// RefResult is one reference an archive provides, after import or verification.
type RefResult struct {
	Ref    string
	Digest string
	Result pinning.PinResult
	Err    error
}

// Load makes every reference idx provides present and pinned, for the archive owner names (the
// plan's first archive by name that provides it). A tarball is imported only when one
// of its images is missing or points elsewhere; otherwise its references are only verified and
// pinned. A list pulls, through the CRI, what is not present. imported says whether content was
// imported or pulled.
func (im *importer) Load(ctx context.Context, idx *airgap.Index, snap *storeSnapshot, owner func(ref string) string) (refs []RefResult, imported bool, err error) {
	// containerd's content client leaves the stream of each blob it writes open after the commit
	// (its Close only half-closes it), and gRPC keeps a goroutine and the stream's buffers for
	// every such stream until its context ends. Under k3s that context is the agent's, which never
	// ends: a cold load of 10,000 references left tens of thousands of them. The archive's own
	// context ends them when its load returns.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if idx.Format == airgap.ImageList {
		snap.wrote() // pulls and pins through the CRI, which the snapshot does not see
		return im.pullList(ctx, idx)
	}
	targets, complete, err := im.presentTargets(ctx, idx, snap)
	if err != nil {
		return nil, false, err
	}
	var failed []failedImage
	if !complete {
		// The lease holds the imported content until the references exist: released earlier,
		// containerd's GC may collect content that no image refers to yet.
		lease, err := snap.importLease(ctx, im)
		if err != nil {
			return nil, false, fmt.Errorf("lease: %w", err)
		}
		ctx = leases.WithLease(ctx, lease)
		all, writes, err := im.importTarball(ctx, snap, idx)
		if err != nil {
			return nil, false, &airgap.ArchiveError{Path: idx.Archive.Path, Err: err}
		}
		targets, imported = indexed(all, idx), true
		snap.wrote()
		faultPoint("import") // content imported, no reference created yet
		targets, failed = im.checkImported(ctx, targets, writes)
	}
	for _, f := range failed {
		for _, name := range References(f.img.Name, f.img.Target.Digest, im.extraRegistries) {
			refs = append(refs, RefResult{Ref: name, Err: &airgap.ArchiveError{Path: idx.Archive.Path, Err: fmt.Errorf("%s: %w", f.img.Name, f.err)}})
		}
	}
	for _, img := range targets {
		// A reference two tarballs provide with the same image is loaded by both, side by side:
		// whichever creates it pins it for its owner, the first by name, as a load in turn would.
		source := owner(img.Name)
		if source == "" {
			source = idx.Archive.Name()
		}
		names := References(img.Name, img.Target.Digest, im.extraRegistries)
		whole := imported || snap.lookup // a sync's listed target lacks its annotations (listedImage)
		identified := false              // the image's ID record is there: its names are made as the CRI marks them
		for _, name := range names {
			// As the snapshot has it (a restore's asks now: a Get, not a Create refused and a Get).
			listed, ok, err := im.image(ctx, snap, name)
			if err != nil {
				refs = append(refs, RefResult{Ref: name, Err: err})
				continue
			}
			var opts []pinning.PutOpt
			if ok {
				opts = append(opts, pinning.WithListed(listed))
			}
			if !ok || !pinning.Settled(listed, img.Target) {
				snap.wrote()
			}
			if !ok && !whole {
				// A reference made beside a present one points at its target whole, as
				// containerd's import wrote it (annotations and all).
				if present, err := im.cd.Images.Get(ctx, img.Name); err == nil && present.Target.Digest == img.Target.Digest {
					img.Target = present.Target
				}
				whole = true
			}
			if !ok && !identified {
				identified = im.putImageID(ctx, snap, imageID(idx, img.Name), img.Target)
			}
			if identified {
				opts = append(opts, pinning.Managed())
			}
			res, err := im.pinner.Put(ctx, images.Image{Name: name, Target: img.Target}, source, opts...)
			refs = append(refs, RefResult{Ref: name, Digest: img.Target.Digest.String(), Result: res, Err: err})
		}
	}
	return refs, imported, nil
}

// failedImage is an imported image that cannot be named: its content is incomplete, or could not
// be labelled.
type failedImage struct {
	img images.Image
	err error
}

// checkImported returns the imported targets that are complete for the node's platform, each
// blob labelled (labelContent), and the others with why. Before any name points at them: without
// its GC labels, an image's content goes with the lease. The manifests and indexes the import
// wrote are read from what its writers saw (writes).
func (im *importer) checkImported(ctx context.Context, targets []images.Image, writes *archiveImport) (ok []images.Image, failed []failedImage) {
	for _, img := range targets {
		// The index checked entries by name; a blob whose content does not match the digest its
		// name claims is stored under its real digest, and the image would lack it.
		if err := complete(ctx, writes, img.Target); err != nil {
			failed = append(failed, failedImage{img, err})
		} else {
			ok = append(ok, img)
		}
	}
	if err := im.labelContent(ctx, writes, ok); err != nil {
		for _, img := range ok {
			failed = append(failed, failedImage{img, err})
		}
		return nil, failed
	}
	return ok, failed
}

// blobLabels are the labels one blob needs: on a manifest or an index, containerd's GC labels
// naming its children (what keeps them once the import's lease ends, as containerd's own import
// sets them); on every blob, containerd's distribution-source labels, as k3s sets them: the
// embedded registry (spegel) serves content to peers only for the registries these name, the
// image's own and each --airgap-extra-registry, with the repositories of refs (the images the
// blob is content of) as value, sorted and comma-separated as containerd writes them.
func (im *importer) blobLabels(refs []string, children []ocispec.Descriptor) map[string]string {
	labels := map[string]string{}
	for _, ref := range refs {
		named, err := reference.ParseDockerRef(ref)
		if err != nil {
			continue // no registry to name
		}
		for _, reg := range append([]string{reference.Domain(named)}, im.extraRegistries...) {
			key := containerdlabels.LabelDistributionSource + "." + strings.TrimSuffix(reg, "/")
			labels[key] = joinRepositories(labels[key], reference.Path(named))
		}
	}
	seen := map[string]int{}
	for _, child := range children {
		// Numbered as containerd's images.SetChildrenLabels numbers them.
		for _, key := range images.ChildGCLabels(child) {
			n := seen[key]
			seen[key] = n + 1
			if n > 0 || strings.HasSuffix(key, ".") {
				key = fmt.Sprintf("%s%d", key, n)
			}
			labels[key] = child.Digest.String()
		}
	}
	return labels
}

// joinRepositories is a distribution-source label's value with the repositories of another added.
func joinRepositories(value, add string) string {
	repos := strings.Split(add, ",")
	if value != "" {
		repos = append(repos, strings.Split(value, ",")...)
	}
	slices.Sort(repos)
	return strings.Join(slices.Compact(repos), ",")
}

// withLabels are have's labels with want's set, a distribution-source label's repositories added
// to those it names, and the keys that changed.
func withLabels(have, want map[string]string) (map[string]string, []string) {
	out := map[string]string{}
	var changed []string
	for _, key := range slices.Sorted(maps.Keys(want)) {
		v := want[key]
		if strings.HasPrefix(key, containerdlabels.LabelDistributionSource+".") {
			v = joinRepositories(have[key], v)
		}
		out[key] = v
		if have[key] != v {
			changed = append(changed, key)
		}
	}
	return out, changed
}

// labelContent gives each blob of the imported targets the labels it needs (blobLabels), for all
// the targets it is content of, in one write per blob, and none for a blob writes committed with
// them. Only these keys are written. A cold load waits on containerd's transactions, one per
// write.
func (im *importer) labelContent(ctx context.Context, writes *archiveImport, targets []images.Image) error {
	cs := im.cd.Content
	var order []digest.Digest
	refs, children := map[digest.Digest][]string{}, map[digest.Digest][]ocispec.Descriptor{}
	for _, img := range targets {
		walk := images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
			if _, ok := refs[desc.Digest]; !ok {
				kids, err := images.Children(ctx, writes, desc)
				if errdefs.IsNotFound(err) {
					return nil, nil // another platform's content, left out of the archive
				}
				if err != nil {
					return nil, err
				}
				order, children[desc.Digest] = append(order, desc.Digest), kids
			}
			if !slices.Contains(refs[desc.Digest], img.Name) {
				refs[desc.Digest] = append(refs[desc.Digest], img.Name)
			}
			return children[desc.Digest], nil
		})
		if err := images.Walk(ctx, walk, img.Target); err != nil {
			return err
		}
	}
	for _, d := range order {
		want := im.blobLabels(refs[d], children[d])
		if _, changed := withLabels(writes.committed[d], want); len(want) == 0 || len(changed) == 0 {
			continue
		}
		info, err := cs.Info(ctx, d)
		if errdefs.IsNotFound(err) {
			continue // another platform's layer, left out of the archive
		}
		if err != nil {
			return fmt.Errorf("labels of %s: %w", d, err)
		}
		labels, changed := withLabels(info.Labels, want)
		if len(changed) == 0 {
			continue
		}
		fields := make([]string, 0, len(changed))
		for _, key := range changed {
			fields = append(fields, pinning.LabelField(key))
		}
		if _, err := cs.Update(ctx, content.Info{Digest: d, Labels: labels}, fields...); err != nil {
			if errdefs.IsNotFound(err) {
				continue
			}
			return fmt.Errorf("labels of %s: %w", d, err)
		}
	}
	return nil
}

// indexed are the imported images that idx lists: an archive whose claim on a reference another
// archive overrules (see ownership) imports its content but does not create that reference.
func indexed(imported []images.Image, idx *airgap.Index) []images.Image {
	listed := map[string]bool{}
	for _, img := range idx.Images {
		listed[img.Ref] = true
	}
	var out []images.Image
	for _, img := range imported {
		if listed[img.Name] {
			out = append(out, img)
		}
	}
	return out
}

// complete checks that the node's platform of the image target has all its content in the store
// provider reads.
func complete(ctx context.Context, provider content.Provider, target ocispec.Descriptor) error {
	available, _, _, missing, err := images.Check(ctx, provider, target, platforms.Default())
	if err != nil {
		return err
	}
	if !available || len(missing) > 0 {
		var names []string
		for _, m := range missing {
			names = append(names, m.Digest.String())
		}
		return fmt.Errorf("content missing from the archive (a blob's content does not match its name?): %s", strings.Join(names, ", "))
	}
	return nil
}

// References are all the names one image of an archive gets, as k3s names what it imports: its
// own, repo@digest (once the digest is known), and per --airgap-extra-registry the tag and the
// digest under that registry; a registry that already hosts the image (the name starts with it)
// adds nothing, so that a registry with a path is not repeated.
func References(name string, dgst digest.Digest, extraRegistries []string) []string {
	names := []string{name}
	if dr := digestRef(name, dgst); dr != "" {
		names = append(names, dr)
	}
	if len(extraRegistries) == 0 {
		return names // the usual case, without parsing name again
	}
	tagged, err := reference.ParseDockerRef(name)
	if err != nil {
		return names
	}
	t, ok := tagged.(reference.NamedTagged)
	if !ok {
		return names
	}
	seen := map[string]bool{}
	for _, reg := range extraRegistries {
		reg = strings.TrimSuffix(reg, "/")
		if reg == "" || seen[reg] || strings.HasPrefix(t.Name(), reg+"/") {
			continue
		}
		seen[reg] = true
		names = append(names, fmt.Sprintf("%s/%s:%s", reg, reference.Path(t), t.Tag()))
		if dgst != "" {
			names = append(names, fmt.Sprintf("%s/%s@%s", reg, reference.Path(t), dgst))
		}
	}
	return names
}

// storeSnapshot is the image store and the content store, each listed once when first asked:
// verifying that every reference of the images dir is present, complete and pinned then costs two
// calls to containerd, not one or more per reference (a warm restart of 10,000 references). It is
// a moment's view: what changes after it is seen by the events Run follows, and by the next sync.
// A sync makes one (listedStore), and archives imported side by side share it. A restore makes a
// lookupStore instead: it asks for one archive's references, and a list of the whole store per
// restored archive would make the disk-pressure path cost O(store) per archive.
type storeSnapshot struct {
	mu     sync.Mutex
	lookup bool // a Get per reference and an Info per blob, no list
	// listed are the image records as listed or got (sorted by name), once, which the sync's
	// later passes take (take) rather than a copy; isListed: the store was listed.
	listed   imageRecords
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
func (snap *storeSnapshot) importLease(ctx context.Context, im *importer) (string, error) {
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
func (snap *storeSnapshot) endImports(ctx context.Context, im *importer) {
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
func (snap *storeSnapshot) wrote() {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	snap.written = true
}

// listedStore is a sync's snapshot: each store listed once, when first asked.
func listedStore() *storeSnapshot { return &storeSnapshot{} }

// lookupStore is a restore's: each reference and blob asked for, and remembered.
func lookupStore() *storeSnapshot {
	return &storeSnapshot{lookup: true, content: newBlobSet()}
}

// image is the reference ref as the snapshot has it; the first call of a listed snapshot lists
// the image store.
func (im *importer) image(ctx context.Context, snap *storeSnapshot, ref string) (images.Image, bool, error) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	if snap.lookup {
		if r, ok := snap.listed.find(ref); ok {
			return r.image(), true, nil
		}
		img, err := im.cd.Images.Get(ctx, ref)
		if errdefs.IsNotFound(err) {
			return images.Image{}, false, nil
		}
		if err != nil {
			return images.Image{}, false, fmt.Errorf("image %s: %w", ref, err)
		}
		snap.listed = snap.listed.insert(listedImage{Name: img.Name, Labels: img.Labels, Target: &img.Target})
		return img, true, nil
	}
	if err := im.listImages(ctx, snap); err != nil {
		return images.Image{}, false, err
	}
	if r, ok := snap.listed.find(ref); ok {
		return r.image(), true, nil
	}
	return images.Image{}, false, nil
}

// listImages lists the image store into a listed snapshot, unless it is listed; snap.mu is held.
func (im *importer) listImages(ctx context.Context, snap *storeSnapshot) error {
	if snap.isListed {
		return nil
	}
	listed, err := listRecords(ctx, im.cd.Images)
	if err != nil {
		return fmt.Errorf("list images: %w", err)
	}
	snap.listed, snap.isListed = listed, true
	return nil
}

// listFirst lists the image store into a listed snapshot before the sync indexes the images dir,
// not at its first load: containerd's answer, which gRPC holds whole while it is decoded (12 MiB
// at 10,000 references), and the decoding's garbage are then gone before the archives' indexes
// are made, rather than beside them at the sync's peak. A failure is the loads' to report: each
// lists again when it first asks. With only .txt lists in the dir (their pulls write through the
// CRI), the sync lists the store again after them: one list more than before this was moved.
func (im *importer) listFirst(ctx context.Context, snap *storeSnapshot) {
	snap.mu.Lock()
	defer snap.mu.Unlock()
	im.listImages(ctx, snap)
}

// take is the image store as a listed snapshot listed it, false if it never listed the store or
// a load wrote to it since; either way the snapshot lets go of its lists, so that what the sync
// does next (a list of the store after its loads, the keep-set, the state) does not hold them too.
func (snap *storeSnapshot) take() (imageRecords, bool) {
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
func (im *importer) hasContent(ctx context.Context, snap *storeSnapshot, d digest.Digest) (bool, error) {
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
func (im *importer) walkContent(ctx context.Context, snap *storeSnapshot) error {
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
// bytes, not its string as containerd's answer decoded it (71 bytes): at 10,000 references a
// sync's walk of the content store held 4.1 MB, map and strings, through the sync's loads.
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

// layerIndexStore is the content store as containerd's archive import sees it during a sync. For
// every image of a docker archive that import walks the whole content store, filtered, to find a
// compressed copy of each layer: N images made a cold load O(N²) in the size of the store (at
// 1,000 images, 40% of the work in-process). This store answers that one query from the
// snapshot's single walk. Blobs imported during the sync carry no such label (import stores
// layers as the archive has them), so the answer is the walk's; a blob labelled by a pull since
// is found by the next sync, and meanwhile the layer is stored as the archive has it.
type layerIndexStore struct {
	content.Store
	im     *importer
	snap   *storeSnapshot
	writes *archiveImport // what the import of one archive writes
}

func (s layerIndexStore) Writer(ctx context.Context, opts ...content.WriterOpt) (content.Writer, error) {
	return s.writes.writer(ctx, s.Store, opts)
}

// ReaderAt reads what the import wrote from what its writers kept (archiveImport.ReaderAt):
// containerd's import reads back each docker image's manifest and config (for its platform) and
// the start of each layer (for its compression), three reads and three lookups per image.
func (s layerIndexStore) ReaderAt(ctx context.Context, desc ocispec.Descriptor) (content.ReaderAt, error) {
	return s.writes.ReaderAt(ctx, desc)
}

// writerStalled is how long another writer of a ref may write nothing before the import writes
// the blob under a ref of its own (openWriter).
var writerStalled = 10 * time.Second

// openWriter opens a writer of cs with opts (whose ref is ref), and gets past a ref whose lock
// containerd lost.
// containerd's metadata store takes a ref's lock inside the transaction that records the ingest;
// when that transaction fails to commit (a full disk: "write meta.db: no space left on device")
// it returns the error and keeps the lock until it restarts. Every later writer of the ref is then
// told it is locked, and containerd's client (content.OpenWriter) waits for as long as its context
// lasts: a sync that never ends once the disk has room again (seen on containerd 1.7.35; 2.2's
// code is the same). A locked ref whose ingest containerd has no record of, or whose data has not
// grown for writerStalled, is written under a ref of its own; a writer at work is waited for, as
// the client does.
func openWriter(ctx context.Context, cs content.Store, ref string, opts []content.WriterOpt) (content.Writer, error) {
	w, err := cs.Writer(ctx, opts...)
	if !errdefs.IsUnavailable(err) {
		return w, err
	}
	offset, since := int64(-1), time.Now()
	for {
		st, serr := cs.Status(ctx, ref)
		if errdefs.IsNotFound(serr) {
			break // locked, yet no ingest: the lock of a transaction that failed
		} else if serr != nil {
			return nil, err
		}
		if st.Offset != offset {
			offset, since = st.Offset, time.Now()
		} else if time.Since(since) >= writerStalled {
			break
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(writerStalled / 20):
		}
		if w, err = cs.Writer(ctx, opts...); !errdefs.IsUnavailable(err) {
			return w, err
		}
	}
	own := fmt.Sprintf("%s-%d", ref, time.Now().UnixNano())
	logrus.Warnf("containerd holds the lock of %s with no writer at work on it (%v): writing it as %s", ref, err, own)
	return cs.Writer(ctx, append(slices.Clip(opts), content.WithRef(own))...)
}

// uncompressedFilter is how containerd's import asks for the compressed copies of one layer.
const uncompressedFilter = `labels."` + containerdlabels.LabelUncompressed + `"==`

func (s layerIndexStore) Walk(ctx context.Context, fn content.WalkFunc, filters ...string) error {
	var layers []digest.Digest
	for _, f := range filters {
		d, err := digest.Parse(strings.TrimPrefix(f, uncompressedFilter))
		if !strings.HasPrefix(f, uncompressedFilter) || err != nil {
			return s.Store.Walk(ctx, fn, filters...) // not the import's query: ask containerd
		}
		layers = append(layers, d)
	}
	if len(layers) == 0 || s.snap.lookup {
		return s.Store.Walk(ctx, fn, filters...)
	}
	s.snap.mu.Lock()
	err := s.im.walkContent(ctx, s.snap)
	var found []content.Info
	for _, d := range layers {
		found = append(found, s.snap.compressed[d]...)
	}
	s.snap.mu.Unlock()
	if err != nil {
		return err
	}
	for _, info := range found {
		if err := fn(info); err != nil {
			return err
		}
	}
	return nil
}

// presentTargets returns the images of idx as they are in containerd (as snap lists them), and
// whether all of them are there, complete for the node's platform, with the content the archive
// holds (same manifest digest, or for docker archives, whose manifest containerd writes at import,
// the same config). Only what containerd says is not found counts as absent: any other error
// (containerd restarting, a timeout) is returned, and never causes a re-import.
func (im *importer) presentTargets(ctx context.Context, idx *airgap.Index, snap *storeSnapshot) ([]images.Image, bool, error) {
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
func (im *importer) putImageID(ctx context.Context, snap *storeSnapshot, id digest.Digest, target ocispec.Descriptor) bool {
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
func (im *importer) imageIDNames(ctx context.Context, snap *storeSnapshot, id, target digest.Digest) bool {
	if id == "" {
		return false
	}
	img, ok, err := im.image(ctx, snap, id.String())
	return err == nil && ok && img.Target.Digest == target
}

// importTarball imports the content of idx's archive and returns its named top-level images, as
// client.Import does with all platforms and missing content skipped (k3s's options), but creates
// no image record: putRef does, with the pin labels. Each blob the archive's index says which
// images it is content of is committed with its labels; writes is what the import wrote
// (archiveImport). ctx must carry a lease.
func (im *importer) importTarball(ctx context.Context, snap *storeSnapshot, idx *airgap.Index) (named []images.Image, writes *archiveImport, err error) {
	rc, err := airgap.FileOpener(idx.Archive)()
	if err != nil {
		return nil, nil, err
	}
	defer rc.Close()

	cs := im.cd.Content
	writes = &archiveImport{im: im, idx: idx, committed: map[digest.Digest]map[string]string{}, seen: map[digest.Digest][]byte{}, heads: map[digest.Digest]blobHead{}}
	store := layerIndexStore{Store: cs, im: im, snap: snap, writes: writes}
	var desc ocispec.Descriptor
	if idx.Format == airgap.OCIArchive {
		desc, err = importLayout(ctx, store, rc)
	} else {
		desc, err = archive.ImportIndex(ctx, store, rc)
	}
	if err != nil {
		return nil, nil, err
	}
	data, err := content.ReadBlob(ctx, writes, desc)
	if err != nil {
		return nil, nil, err
	}
	var index ocispec.Index
	if err := json.Unmarshal(data, &index); err != nil {
		return nil, nil, err
	}
	for _, m := range index.Manifests {
		name := m.Annotations[images.AnnotationImageName]
		if name == "" {
			name = m.Annotations[ocispec.AnnotationRefName]
		}
		if name != "" {
			named = append(named, images.Image{Name: name, Target: m})
		}
	}
	if len(named) == 0 {
		return nil, nil, errors.New("the archive names no image")
	}
	return named, writes, nil
}

// importLayout imports the OCI image layout read from r into store, as containerd's
// archive.ImportIndex does (every regular file written as a blob, docker's manifest.json beside a
// layout left out, the layout's index.json returned), except that a blob whose name gives its
// digest (blobs/sha256/<encoded>) is written as that digest: containerd hashes every blob it
// stores and refuses to commit one whose bytes are not its digest, and ImportIndex hashed each
// blob again on this side (of a 1 GiB load, a second sha256 of the gigabyte on the node's CPUs).
// A blob the store holds is not read at all: the tar reader seeks past it in an uncompressed
// archive.
func importLayout(ctx context.Context, store content.Ingester, r io.Reader) (ocispec.Descriptor, error) {
	tr := tar.NewReader(r)
	var layout ocispec.ImageLayout
	index, haveIndex := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex}, false
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return ocispec.Descriptor{}, err
		}
		if hdr.Typeflag != tar.TypeReg && hdr.Typeflag != tar.TypeRegA { //nolint:staticcheck // as ImportIndex: old tars write TypeRegA
			continue
		}
		name := path.Clean(hdr.Name)
		switch name {
		case ocispec.ImageLayoutFile:
			if err := json.NewDecoder(io.LimitReader(tr, layoutJSONLimit)).Decode(&layout); err != nil {
				return ocispec.Descriptor{}, fmt.Errorf("untar oci layout %q: %w", hdr.Name, err)
			}
			continue
		case "manifest.json":
			continue // docker's, beside the layout: the layout is what is imported
		}
		desc := ocispec.Descriptor{Size: hdr.Size}
		var src io.Reader = tr
		var dgstr digest.Digester
		if d, ok := layoutBlobDigest(name); ok {
			desc.Digest = d
		} else {
			dgstr = digest.Canonical.Digester()
			src = io.TeeReader(tr, dgstr.Hash())
		}
		err = content.WriteBlob(ctx, store, "tar-"+name, src, desc)
		if desc.Digest != "" && errdefs.IsFailedPrecondition(err) {
			return ocispec.Descriptor{}, fmt.Errorf("%s: its bytes are not the digest its name gives (a damaged archive): %w", name, err)
		} else if err != nil {
			return ocispec.Descriptor{}, fmt.Errorf("failed to ingest %q: %w", hdr.Name, err)
		}
		if name == ocispec.ImageIndexFile {
			index.Digest, index.Size, haveIndex = dgstr.Digest(), hdr.Size, true
		}
	}
	switch {
	case layout.Version == "":
		return ocispec.Descriptor{}, errors.New("not an OCI image layout: no oci-layout file")
	case layout.Version != ocispec.ImageLayoutVersion:
		return ocispec.Descriptor{}, fmt.Errorf("unsupported OCI version %s", layout.Version)
	case !haveIndex:
		return ocispec.Descriptor{}, fmt.Errorf("missing index.json in OCI layout %s", ocispec.ImageLayoutVersion)
	}
	return index, nil
}

// layoutBlobDigest is the digest an OCI layout's blob file name gives (blobs/sha256/<encoded>).
func layoutBlobDigest(name string) (digest.Digest, bool) {
	encoded, ok := strings.CutPrefix(name, "blobs/sha256/")
	d := digest.NewDigestFromEncoded(digest.SHA256, encoded)
	return d, ok && d.Validate() == nil
}

// layoutJSONLimit is how much of an oci-layout file is read, as containerd's import reads it.
const layoutJSONLimit = 20 << 20

// archiveImport is what containerd's import of one archive writes, as its content store
// (layerIndexStore) sees it. Each blob the archive's index describes (airgap.Content) is
// committed with the labels it needs (blobLabels): a cold load then writes no labels of its own.
// What the index cannot tell (an index from a record, a blob that was already there)
// labelContent labels after the import. The archive's own index, which only names the images, is
// kept here and not written: it is no image's content (the lease would take it away), and its
// write was two of containerd's transactions per archive. A cold load waits on them. As a
// content.Provider it reads the manifests and indexes it saw written from their bytes, and the
// rest from containerd: checking and labelling the imported images reads each of them again.
type archiveImport struct {
	im  *importer
	idx *airgap.Index

	mu        sync.Mutex
	committed map[digest.Digest]map[string]string // each blob's labels, as committed
	seen      map[digest.Digest][]byte            // manifests and indexes as written; the archive's own index
	heads     map[digest.Digest]blobHead          // the start of each blob committed, as written
}

// headSize is how much of each blob an import keeps: a small blob whole (a config, a small
// layer), and of a large layer what containerd's import reads to tell its compression (the 32 KiB
// its decompressor buffers).
const headSize = 32 << 10

// blobHead is the start of a blob the import committed, and its size.
type blobHead struct {
	data []byte
	size int64
}

func (ai *archiveImport) ReaderAt(ctx context.Context, desc ocispec.Descriptor) (content.ReaderAt, error) {
	ai.mu.Lock()
	data, ok := ai.seen[desc.Digest]
	head, committed := ai.heads[desc.Digest]
	ai.mu.Unlock()
	switch {
	case ok:
		return blobReader{bytes.NewReader(data)}, nil
	case committed:
		// Committed by this import, under its lease: there. What the head lacks is read from
		// containerd, if it is ever asked for.
		return &headReaderAt{head: head, open: func() (content.ReaderAt, error) { return ai.im.cd.Content.ReaderAt(ctx, desc) }}, nil
	}
	return ai.im.cd.Content.ReaderAt(ctx, desc)
}

// headReaderAt reads a blob from its head, and from containerd past it.
type headReaderAt struct {
	head blobHead
	open func() (content.ReaderAt, error)
	rest content.ReaderAt
}

func (r *headReaderAt) ReadAt(p []byte, off int64) (int, error) {
	whole := int64(len(r.head.data)) == r.head.size
	if off >= 0 && (off+int64(len(p)) <= int64(len(r.head.data)) || whole) {
		if off >= r.head.size {
			return 0, io.EOF
		}
		n := copy(p, r.head.data[off:])
		if n < len(p) {
			return n, io.EOF
		}
		return n, nil
	}
	if r.rest == nil {
		var err error
		if r.rest, err = r.open(); err != nil {
			return 0, err
		}
	}
	return r.rest.ReadAt(p, off)
}

func (r *headReaderAt) Size() int64 { return r.head.size }

func (r *headReaderAt) Close() error {
	if r.rest != nil {
		return r.rest.Close()
	}
	return nil
}

// writer opens the writer of containerd's import with opts: the blob committed with its labels,
// or, for the archive's own index, a writer that keeps its bytes here.
func (ai *archiveImport) writer(ctx context.Context, cs content.Store, opts []content.WriterOpt) (content.Writer, error) {
	var wo content.WriterOpts
	for _, opt := range opts {
		if err := opt(&wo); err != nil {
			return nil, err
		}
	}
	name, file := strings.CutPrefix(wo.Ref, "tar-")
	if file && name == ocispec.ImageIndexFile || strings.HasPrefix(wo.Ref, "manifest-") && images.IsIndexType(wo.Desc.MediaType) {
		// An OCI layout's index.json, or the index containerd writes for a docker archive.
		return &indexWriter{ai: ai, ref: wo.Ref, digester: digest.Canonical.Digester()}, nil
	}
	w, err := openWriter(ctx, cs, wo.Ref, opts)
	if err != nil {
		return nil, err
	}
	// Every blob's start is kept (heads); the labels only where the archive's index tells them.
	lw := &labelledWriter{Writer: w, ai: ai}
	switch {
	case file && ai.idx.Content != nil:
		// A file of the archive: its images, and its children if it is a manifest or index.
		lw.refs = ai.idx.Content.Refs[name]
		lw.desc.MediaType = ai.idx.Content.MediaTypes[name]
		// Media types are an OCI layout's, whose blobs importLayout writes as the digests their
		// names give.
		lw.desc.Digest = wo.Desc.Digest
		if len(lw.refs) == 0 {
			lw.plain = true
		}
	case strings.HasPrefix(wo.Ref, "manifest-") && images.IsManifestType(wo.Desc.MediaType):
		// The manifest containerd writes for an image of a docker archive: the images with its
		// config (their image ID), once its bytes are read.
		lw.desc = wo.Desc
	default:
		lw.plain = true // a write the archive's index does not describe
	}
	if !lw.plain && (images.IsManifestType(lw.desc.MediaType) || images.IsIndexType(lw.desc.MediaType)) {
		if lw.desc.Digest == "" {
			lw.plain = true // its bytes cannot be checked against its name
		} else {
			lw.data = &bytes.Buffer{}
		}
	}
	return lw, nil
}

// indexWriter keeps the archive's own index in memory, for importTarball to read.
type indexWriter struct {
	ai       *archiveImport
	ref      string
	data     bytes.Buffer
	digester digest.Digester
}

func (w *indexWriter) Write(p []byte) (int, error) {
	w.data.Write(p)
	return w.digester.Hash().Write(p)
}

func (w *indexWriter) Commit(_ context.Context, size int64, expected digest.Digest, _ ...content.Opt) error {
	d := w.digester.Digest()
	if size > 0 && size != int64(w.data.Len()) || expected != "" && expected != d {
		return fmt.Errorf("%s: %d bytes of digest %s, want %d of %s", w.ref, w.data.Len(), d, size, expected)
	}
	w.ai.mu.Lock()
	defer w.ai.mu.Unlock()
	w.ai.seen[d] = w.data.Bytes()
	return nil
}

func (w *indexWriter) Status() (content.Status, error) {
	return content.Status{Ref: w.ref, Offset: int64(w.data.Len())}, nil
}

func (w *indexWriter) Digest() digest.Digest { return w.digester.Digest() }

func (w *indexWriter) Truncate(size int64) error {
	if size != 0 {
		return fmt.Errorf("%s: truncate to %d: only to 0", w.ref, size)
	}
	w.data.Reset()
	w.digester = digest.Canonical.Digester()
	return nil
}

func (w *indexWriter) Close() error { return nil }

// labelledWriter is a writer of containerd's import that commits its blob with its labels, and
// keeps the blob's start (archiveImport.heads).
type labelledWriter struct {
	content.Writer
	ai    *archiveImport
	plain bool               // no labels of its own: committed as containerd's import would
	refs  []string           // the images the blob is content of
	desc  ocispec.Descriptor // its media type and digest, when the name says it
	data  *bytes.Buffer      // a manifest's or index's bytes, whose children it names

	head    []byte // the first bytes written, up to headSize
	written int64  // bytes written from the blob's start; -1 once that is not known
}

func (w *labelledWriter) Write(p []byte) (int, error) {
	n, err := w.Writer.Write(p)
	if w.data != nil {
		w.data.Write(p[:n])
	}
	if w.written >= 0 {
		if w.written == int64(len(w.head)) && len(w.head) < headSize {
			w.head = append(w.head, p[:min(n, headSize-len(w.head))]...)
		}
		w.written += int64(n)
	}
	return n, err
}

// Truncate is content.Copy's restart of a write: what was kept of the bytes no longer is them.
func (w *labelledWriter) Truncate(size int64) error {
	if w.data != nil && size == 0 {
		w.data.Reset()
	} else {
		w.data = nil
	}
	if size == 0 {
		w.head, w.written = w.head[:0], 0
	} else {
		w.head, w.written = nil, -1
	}
	return w.Writer.Truncate(size)
}

func (w *labelledWriter) Commit(ctx context.Context, size int64, expected digest.Digest, opts ...content.Opt) error {
	labels, ok := w.labels()
	if ok {
		opts = append(opts, content.WithLabels(labels))
	}
	if err := w.Writer.Commit(ctx, size, expected, opts...); err != nil {
		return err
	}
	w.ai.mu.Lock()
	defer w.ai.mu.Unlock()
	d := w.Writer.Digest()
	if ok {
		w.ai.committed[d] = labels
		if w.data != nil {
			w.ai.seen[w.desc.Digest] = w.data.Bytes()
			return nil // kept whole: no head of it besides
		}
	}
	if size > 0 && w.written == size {
		// Written whole by this writer (a resumed write began past the start).
		w.ai.heads[d] = blobHead{data: w.head, size: size}
	}
	return nil
}

// labels are the blob's labels; false when it has none of its own, or they cannot be told: a
// manifest or index whose bytes were not all seen (a resumed write), or are not what its name says.
func (w *labelledWriter) labels() (map[string]string, bool) {
	if w.plain {
		return nil, false
	}
	if w.data == nil && (images.IsManifestType(w.desc.MediaType) || images.IsIndexType(w.desc.MediaType)) {
		return nil, false
	}
	var children []ocispec.Descriptor
	if w.data != nil {
		if digest.FromBytes(w.data.Bytes()) != w.desc.Digest {
			return nil, false
		}
		var err error
		if children, err = images.Children(context.Background(), oneBlob(w.data.Bytes()), w.desc); err != nil {
			return nil, false
		}
	}
	refs := w.refs
	if refs == nil && len(children) > 0 {
		// A docker archive's manifest is content of the images whose config it names.
		for _, img := range w.ai.idx.Images {
			if img.ImageID == children[0].Digest {
				refs = append(refs, img.Ref)
			}
		}
	}
	if len(refs) == 0 {
		return nil, false
	}
	return w.ai.im.blobLabels(refs, children), true
}

// oneBlob is a content.Provider of one blob's bytes, for images.Children to read what a writer saw.
type oneBlob []byte

func (b oneBlob) ReaderAt(context.Context, ocispec.Descriptor) (content.ReaderAt, error) {
	return blobReader{bytes.NewReader(b)}, nil
}

type blobReader struct{ *bytes.Reader }

func (blobReader) Close() error { return nil }

// criStatus is the CRI's status of ref. The CRI learns of images from containerd's events, so an
// image a tarball created a moment ago may not be in its view yet: when containerd has ref, the
// CRI is given a moment to catch up rather than asked to pull it (an air-gapped pull fails).
func (im *importer) criStatus(ctx context.Context, ref string) (*runtimeapi.ImageStatusResponse, error) {
	_, inStore := im.cd.Images.Get(ctx, ref)
	deadline := time.Now().Add(2 * time.Second)
	for {
		status, err := im.cd.CRI.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
		if err != nil || status.GetImage() != nil || inStore != nil || time.Now().After(deadline) {
			return status, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// pullList pulls through the CRI (so registry mirrors and credentials apply) each reference of a
// .txt list that is not present, then pins it and the repo@digest reference the CRI created.
func (im *importer) pullList(ctx context.Context, idx *airgap.Index) ([]RefResult, bool, error) {
	if im.cd.CRI == nil {
		return nil, false, &airgap.ArchiveError{Path: idx.Archive.Path, Err: errors.New("no CRI image service to pull the list's entries through")}
	}
	var (
		refs   []RefResult
		pulled bool
		errs   []error
		source = idx.Archive.Name()
	)
	for _, want := range idx.Images {
		status, err := im.criStatus(ctx, want.Ref)
		if err == nil && status.GetImage() == nil && im.pullLater != nil {
			if err = im.pullLater(want.Ref); err == nil {
				refs = append(refs, RefResult{Ref: want.Ref, Err: errPullPending})
				continue
			}
		} else if err == nil && status.GetImage() == nil {
			pctx, cancel := context.WithTimeout(ctx, listPullTimeout)
			if _, err = im.cd.CRI.PullImage(pctx, &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: want.Ref}}); err == nil {
				pulled = true
				status, err = im.cd.CRI.ImageStatus(ctx, &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: want.Ref}})
			} else if pctx.Err() != nil && ctx.Err() == nil {
				err = fmt.Errorf("no answer within %s: %w", listPullTimeout, err)
			}
			cancel()
		}
		if err == nil && status.GetImage() == nil {
			err = errors.New("not present after pull")
		}
		if err != nil {
			err = &airgap.ArchiveError{Path: idx.Archive.Path, Line: want.Line, Err: fmt.Errorf("pull %s: %w", want.Ref, err)}
			refs = append(refs, RefResult{Ref: want.Ref, Err: err})
			errs = append(errs, err)
			continue
		}
		names := []string{want.Ref}
		repo := want.Ref
		if named, err := reference.ParseNormalizedNamed(want.Ref); err == nil {
			repo = named.Name()
		}
		for _, rd := range status.GetImage().GetRepoDigests() {
			if named, err := reference.ParseNormalizedNamed(rd); err == nil && named.Name() == repo && rd != want.Ref {
				names = append(names, rd)
			}
		}
		for _, name := range names {
			r := RefResult{Ref: name}
			img, err := im.cd.Images.Get(ctx, name)
			if err == nil {
				r.Digest = img.Target.Digest.String()
				r.Result, err = im.pinner.PinImage(ctx, img, source)
			}
			if err != nil {
				r.Err = &airgap.ArchiveError{Path: idx.Archive.Path, Line: want.Line, Err: err}
				errs = append(errs, r.Err)
			}
			refs = append(refs, r)
		}
	}
	return refs, pulled, errors.Join(errs...)
}

// normalize is ref as containerd names it (nginx:1 is docker.io/library/nginx:1), or ref.
func normalize(ref string) string {
	named, err := reference.ParseDockerRef(ref)
	if err != nil {
		return ref
	}
	return named.String()
}
