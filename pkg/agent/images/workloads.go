package images

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/docker/go-units"
	"github.com/opencontainers/go-digest"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Workload admission (--pinned-workload-images): whoever may create a Deployment in a namespace
// in scope names what every node keeps, and with --fetch-missing-images what it downloads. So a
// workload's reference enters the plan only within limits: at most MaxWorkloadImages of them, of
// at most MaxWorkloadImageBytes (those wanted for nothing else: an archive's or the policy's
// cost nothing more), and a new one only while the image filesystem is below FetchMaxDiskUsage.
// Limits hold back new pins only: a reference already pinned for a workload, or admitted before,
// stays while a workload names it, so that lowering a limit or a full disk never unpins what a
// workload may run. An image not on the node is admitted by count: its fetch checks its bytes
// (pullGuard).

// admitWorkloads decides which of the workloads' references the plan keeps, from listed (the
// store as this sync listed it), and makes the plan again when that changed. Each reference
// refused is reported once for each reason: an Event naming it, its workloads and the limit.
func (a *Agent) admitWorkloads(ctx context.Context, listed imagelist.Records) {
	if a.workloadImages == nil {
		return
	}
	limit := a.cfg.MaxWorkloadImages
	if limit <= 0 {
		limit = DefaultMaxWorkloadImages
	}
	pinnedFor := map[string]bool{}
	present := map[string]digest.Digest{}
	for img := range listed.Images() {
		if _, named := a.workloadImages[img.Name]; !named {
			continue
		}
		present[img.Name] = img.Target.Digest
		if src, ours := pinning.OwnPin(img.Labels); ours && src == pinning.SourceWorkload {
			pinnedFor[img.Name] = true
		}
	}
	sized := a.workloadBytesCounter(ctx, present)
	admitted := map[string]bool{}
	var newcomers []string
	counted := 0
	for _, ref := range slices.Sorted(maps.Keys(a.workloadImages)) {
		switch {
		case a.plan.WantedBesidesWorkloads(ref):
			admitted[ref] = true
		case pinnedFor[ref] || a.workloads[ref]:
			admitted[ref] = true
			counted++
			sized.add(ref)
		default:
			newcomers = append(newcomers, ref)
		}
	}
	refused := map[string]string{}
	var diskChecked bool
	var diskFull string
	for _, ref := range newcomers {
		if counted >= limit {
			refused[ref] = fmt.Sprintf("--%s %d reached", FlagMaxWorkloadImages, limit)
			continue
		}
		if why := sized.beyond(ref); why != "" {
			refused[ref] = why
			continue
		}
		if !diskChecked {
			diskChecked = true
			above, why, err := a.imagefsAbove(ctx, 0)
			if err != nil {
				// When the usage cannot be told, the image is kept: the kubelet's own GC
				// thresholds still apply to everything else.
				logrus.Warnf("workload images: %v; admitting them", err)
			} else if above {
				diskFull = why
			}
		}
		if diskFull != "" {
			refused[ref] = diskFull
			continue
		}
		admitted[ref] = true
		counted++
		sized.add(ref)
	}
	for _, ref := range slices.Sorted(maps.Keys(refused)) {
		if a.refused[ref] == refused[ref] {
			continue
		}
		owners := firstFew(slices.Sorted(slices.Values(a.workloadImages[ref])))
		logrus.Warnf("%s, named by %s, not kept: %s", ref, owners, refused[ref])
		a.event(true, ReasonWorkloadImageRefused, "%s, named by %s, not kept: %s", ref, owners, refused[ref])
	}
	for ref := range a.refused {
		if admitted[ref] {
			logrus.Infof("%s is kept for its workloads now", ref)
		}
	}
	a.refused, a.workloadBytes, a.sizes = refused, sized.kept, sized.sizes
	if a.workloads == nil || !maps.Equal(admitted, a.workloads) {
		a.workloads = admitted
		a.replan()
	}
}

// workloadBytes adds up the images admitted for workloads alone, each image once, against
// MaxWorkloadImageBytes; without that bound it reads nothing.
type workloadBytes struct {
	ctx     context.Context
	a       *Agent
	present map[string]digest.Digest // reference -> the image it names on the node
	sizes   map[digest.Digest]int64  // sizes read this admission (from the last one's first)
	counted map[digest.Digest]bool
	kept    int64
}

func (a *Agent) workloadBytesCounter(ctx context.Context, present map[string]digest.Digest) *workloadBytes {
	return &workloadBytes{ctx: ctx, a: a, present: present, sizes: map[digest.Digest]int64{}, counted: map[digest.Digest]bool{}}
}

// size is the size of the image ref names on the node; ok false when it is not there, or cannot
// be read (then it counts nothing: when unsure, keep).
func (b *workloadBytes) size(ref string) (d digest.Digest, size int64, ok bool) {
	d, ok = b.present[ref]
	if !ok || b.a.cfg.MaxWorkloadImageBytes <= 0 {
		return "", 0, false
	}
	if size, ok = b.sizes[d]; ok {
		return d, size, true
	}
	if size, ok = b.a.sizes[d]; !ok {
		var err error
		if size, err = imageSize(b.ctx, b.a.cd.Content, d); err != nil {
			logrus.Warnf("workload images: the size of %s (%s) cannot be read: %v", ref, d, err)
			return "", 0, false
		}
	}
	b.sizes[d] = size
	return d, size, true
}

func (b *workloadBytes) add(ref string) {
	if d, size, ok := b.size(ref); ok && !b.counted[d] {
		b.counted[d] = true
		b.kept += size
	}
}

// beyond says why ref's image does not fit what is kept, or "".
func (b *workloadBytes) beyond(ref string) string {
	d, size, ok := b.size(ref)
	if !ok || b.counted[d] || b.kept+size <= b.a.cfg.MaxWorkloadImageBytes {
		return ""
	}
	return fmt.Sprintf("--%s %s reached (%s kept, this image %s)", FlagMaxWorkloadImageBytes,
		units.BytesSize(float64(b.a.cfg.MaxWorkloadImageBytes)), units.BytesSize(float64(b.kept)), units.BytesSize(float64(size)))
}
