package keep

import (
	"fmt"

	"github.com/opencontainers/go-digest"

	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
)

// Conflict is a reference that two tarballs of the images dir provide with different images. The
// rule is deterministic: the first tarball by file name provides it; the later tarball's claim is
// skipped (its other references still load). Without the rule each sync would re-import both and
// the reference would flip between them.
type Conflict struct {
	Ref           string
	Owner         string        // archive file name that provides Ref
	OwnerImage    digest.Digest // what Ref is in the owner (image ID, or manifest digest)
	Shadowed      string        // archive file name whose claim is skipped
	ShadowedImage digest.Digest
}

func (c Conflict) String() string {
	return fmt.Sprintf("%s is provided by %s (%s) and by %s (%s): %s wins, the first by name; %s's copy is not loaded",
		c.Ref, c.Owner, short(c.OwnerImage), c.Shadowed, short(c.ShadowedImage), c.Owner, c.Shadowed)
}

func short(d digest.Digest) string {
	if s := d.Encoded(); len(s) > 12 {
		return d.Algorithm().String() + ":" + s[:12]
	}
	return d.String()
}

// owners is which tarball provides each reference, and the claims it overruled.
type owners struct {
	ref       map[string]string // reference -> archive file name
	conflicts []Conflict
}

// ownership assigns every reference the tarballs provide to the first tarball, by file name, that
// provides it. indexes must be in file-name order; an archive that cannot be read now is passed
// with its recorded index, so that a damaged file keeps the references it loaded. .txt lists own
// nothing: they name no image, and are satisfied by whatever a tarball loaded under the name.
func ownership(indexes []*airgap.Index) *owners {
	o := &owners{ref: map[string]string{}}
	first := map[string]airgap.IndexedImage{}
	for _, idx := range indexes {
		if idx.Format == airgap.ImageList {
			continue
		}
		for _, img := range idx.Images {
			owner, taken := o.ref[img.Ref]
			if !taken {
				o.ref[img.Ref], first[img.Ref] = idx.Archive.Name(), img
				continue
			}
			if owner == idx.Archive.Name() {
				continue
			}
			if a, b := identity(first[img.Ref], img); a != b {
				o.conflicts = append(o.conflicts, Conflict{Ref: img.Ref, Owner: owner, OwnerImage: a, Shadowed: idx.Archive.Name(), ShadowedImage: b})
			}
		}
	}
	return o
}

// identity is how two archives' copies of a reference compare: by image ID (the config digest,
// what the CRI and the kubelet call the image) when both know it, else by manifest digest. The
// same image saved by `docker save` and as an OCI layout has different manifests but one ID.
func identity(a, b airgap.IndexedImage) (digest.Digest, digest.Digest) {
	if a.ImageID != "" && b.ImageID != "" {
		return a.ImageID, b.ImageID
	}
	if a.Digest != "" && b.Digest != "" {
		return a.Digest, b.Digest
	}
	return "", ""
}

// loadable is idx without the references whose claim another tarball overrules: what archive idx
// may load. A reference two tarballs provide with the same image stays in both: either can
// restore it, and it passes to the other when one leaves.
func (o *owners) loadable(idx *airgap.Index) *airgap.Index {
	lost := o.shadowed(idx.Archive.Name())
	if len(lost) == 0 {
		return idx
	}
	skip := map[string]bool{}
	for _, c := range lost {
		skip[c.Ref] = true
	}
	out := &airgap.Index{Archive: idx.Archive, Format: idx.Format, Content: idx.Content}
	for _, img := range idx.Images {
		if !skip[img.Ref] {
			out.Images = append(out.Images, img)
		}
	}
	return out
}

// of is the tarball that provides ref, "" for none.
func (o *owners) of(ref string) string { return o.ref[ref] }

// shadowed are the conflicts in which archive name lost.
func (o *owners) shadowed(name string) []Conflict {
	var out []Conflict
	for _, c := range o.conflicts {
		if c.Shadowed == name {
			out = append(out, c)
		}
	}
	return out
}
