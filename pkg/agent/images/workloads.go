package images

import (
	"context"
	"fmt"
	"maps"
	"slices"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// Workload admission (--pinned-workload-images): whoever may create a Deployment in a namespace
// in scope names what every node keeps, and with --fetch-missing-images what it downloads. So a
// workload's reference enters the plan only within limits: at most MaxWorkloadImages of them
// (those wanted for nothing else: an archive's or the policy's cost nothing more), and a new one
// only while the image filesystem is below FetchMaxDiskUsage. Limits hold back new pins only: a
// reference already pinned for a workload, or admitted before, stays while a workload names it,
// so that lowering a limit or a full disk never unpins what a workload may run.

// admitWorkloads decides which of the workloads' references the plan keeps, from listed (the
// store as this sync listed it), and makes the plan again when that changed. Each reference
// refused is reported once for each reason: an Event naming it, its workloads and the limit.
func (a *Agent) admitWorkloads(ctx context.Context, listed imageRecords) {
	if a.workloadImages == nil {
		return
	}
	limit := a.cfg.MaxWorkloadImages
	if limit <= 0 {
		limit = DefaultMaxWorkloadImages
	}
	pinnedFor := map[string]bool{}
	for img := range listed.images() {
		if src, ours := pinning.OwnPin(img.Labels); ours && src == pinning.SourceWorkload {
			pinnedFor[img.Name] = true
		}
	}
	admitted := map[string]bool{}
	var newcomers []string
	counted := 0
	for _, ref := range slices.Sorted(maps.Keys(a.workloadImages)) {
		switch {
		case a.plan.wantedBesidesWorkloads(ref):
			admitted[ref] = true
		case pinnedFor[ref] || a.workloads[ref]:
			admitted[ref] = true
			counted++
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
		if !diskChecked {
			diskChecked = true
			above, why, err := a.imagefsAbove(ctx)
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
	a.refused = refused
	if a.workloads == nil || !maps.Equal(admitted, a.workloads) {
		a.workloads = admitted
		a.replan()
	}
}

// wantedBesidesWorkloads reports whether an archive or the policy wants ref, whatever the
// workloads say.
func (p *Plan) wantedBesidesWorkloads(ref string) bool {
	_, provided := p.refs[ref]
	return provided || p.policy.Wants(images.Image{Name: ref})
}
