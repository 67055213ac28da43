package images

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	containerdlabels "github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/k3s-pinning/k3s-pinning/internal/fault"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/keep"
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
	// digestRefs is the agent's memo of repo@digest names.
	digestRefs *keep.DigestRefs
	// writerStalled is openWriter's patience with another writer of a ref (defaultWriterStalled).
	writerStalled time.Duration
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
func (im *importer) Load(ctx context.Context, idx *airgap.Index, snap *storeCache, owner func(ref string) string) (refs []RefResult, imported bool, err error) {
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
		fault.Point("import") // content imported, no reference created yet
		targets, failed = im.checkImported(ctx, targets, writes)
	}
	for _, f := range failed {
		for _, name := range im.digestRefs.References(f.img.Name, f.img.Target.Digest, im.extraRegistries) {
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
		names := im.digestRefs.References(img.Name, img.Target.Digest, im.extraRegistries)
		whole := imported || snap.lookup // a sync's listed target lacks its annotations (imagelist.Record)
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
