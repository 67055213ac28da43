// Package pinning decides which images must be kept on a node and keeps the CRI pin label on them.
//
// The CRI plugin of containerd reports an image as pinned when any of its references carries
// LabelPinned=PinnedValue, and the kubelet never garbage-collects a pinned image. Every pin this
// package sets also carries LabelSource, so a pin we set can always be told from one a user or
// k3s set, and we never remove a pin we did not set.
package pinning

import "strings"

const (
	// LabelPinned is the label the containerd CRI plugin reads to report an image as pinned.
	LabelPinned = "io.cri-containerd.pinned"
	// PinnedValue is the only value of LabelPinned that the CRI plugin honours.
	PinnedValue = "pinned"
	// LabelSource marks a pin as set by k3s-pinning and names what wants the image kept: an
	// archive file name in the images dir, SourcePolicy or SourceManual.
	LabelSource = "io.k3s-pinning.source"
	// LabelK3sPinned is the label stock k3s sets beside LabelPinned on what it imports. k3s clears
	// LabelPinned from images carrying it at every start, then re-imports.
	LabelK3sPinned = "io.cattle.k3s.pinned"
	// LabelCRIManaged=CRIManagedValue is the CRI plugin's mark on every image name it knows. A
	// name created without it, the CRI updates as soon as it hears of it: it makes the image's ID
	// record (a name sha256:<config digest>), then writes the mark, a transaction each.
	LabelCRIManaged = "io.cri-containerd.image"
	// CRIManagedValue is LabelCRIManaged's value.
	CRIManagedValue = "managed"

	// SourcePolicy is the source of pins set because --pinned-images or --pinned-image-labels match.
	SourcePolicy = "policy"
	// SourceManual is the source of pins set by `k3s-pinning pin`.
	SourceManual = "manual"
	// SourceWorkload is the source of pins set because a workload of the cluster references the
	// image (--pinned-workload-images).
	SourceWorkload = "workload"

	// DefaultNamespace is the containerd namespace the CRI plugin (and so the kubelet) uses.
	DefaultNamespace = "k8s.io"
)

// IsArchiveSource reports whether source, what our pin records, names an archive of the images
// dir rather than the policy, a hand pin or a workload.
func IsArchiveSource(source string) bool {
	return source != SourcePolicy && source != SourceManual && source != SourceWorkload
}

// IsPinned reports whether labels carry the exact pin the CRI plugin honours.
func IsPinned(labels map[string]string) bool { return labels[LabelPinned] == PinnedValue }

// OwnPin reports whether the pin in labels was set by us, and for which source.
func OwnPin(labels map[string]string) (source string, ok bool) {
	source, ok = labels[LabelSource]
	return source, ok && IsPinned(labels)
}

// Owner is who holds the pin on a reference: the one distinction every pin write makes, since we
// never touch a pin we did not set.
type Owner int

const (
	NoPin    Owner = iota // not pinned: ours to set
	OurPin                // pinned by k3s-pinning (LabelSource names what wants it)
	TheirPin              // pinned by a user or k3s: left as it is
)

// OwnerOf is who holds the pin in labels.
func OwnerOf(labels map[string]string) Owner {
	switch _, ours := OwnPin(labels); {
	case ours:
		return OurPin
	case IsPinned(labels):
		return TheirPin
	default:
		return NoPin
	}
}

// LabelField is the field path that names label key in a containerd Update or List filter.
func LabelField(key string) string { return "labels." + key }

// pinFields are the two labels every pin write sets or removes, and nothing else.
var pinFields = []string{LabelField(LabelPinned), LabelField(LabelSource)}

// PinLabels are the labels a reference wanted by source carries.
func PinLabels(source string) map[string]string {
	return map[string]string{LabelPinned: PinnedValue, LabelSource: source}
}

// MisspelledPin returns a description of a label that looks like a pin label but that the CRI
// ignores (io.cri.containerd.pinned, io.cri-containerd.pinned=true, ...), or "" when none does.
func MisspelledPin(labels map[string]string) string {
	for k, v := range labels {
		if k == LabelPinned {
			if v != PinnedValue {
				return k + "=" + v + " (the CRI only honours the value \"" + PinnedValue + "\")"
			}
			continue
		}
		if looksLikePinKey(k) {
			return k + "=" + v + " (the CRI only honours the key " + LabelPinned + ")"
		}
	}
	return ""
}

// looksLikePinKey matches keys that differ from LabelPinned only in case and punctuation.
func looksLikePinKey(k string) bool {
	squash := func(s string) string {
		var b strings.Builder
		for _, r := range strings.ToLower(s) {
			if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
				b.WriteRune(r)
			}
		}
		return b.String()
	}
	return squash(k) == squash(LabelPinned)
}
