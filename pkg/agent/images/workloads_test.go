package images_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/platforms"

	agentimages "github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// namedByWorkloads are refs as the workload watcher reports them: each named by a Deployment of
// its own.
func namedByWorkloads(refs ...string) agentimages.WorkloadImages {
	named := agentimages.WorkloadImages{}
	for i, ref := range refs {
		named[ref] = append(named[ref], fmt.Sprintf("Deployment tenant/w%d", i))
	}
	return named
}

// TestWorkloadImagesWithinLimits (issue "Trust", item 2): on a real containerd, a node keeps at
// most --max-workload-images references for workloads (an archive's, named by a workload too,
// costs nothing); above --fetch-max-disk-usage it pins no new one, while the archives' pins and
// the workload pins it has stay; each refusal is an Event naming the image, its workload and the
// limit; a refused image is kept once there is room; lowering the limit unpins nothing.
func TestWorkloadImagesWithinLimits(t *testing.T) {
	n := newNode(t)
	writeArchive(t, n.imagesDir, archiveCase{file: "airgap.tar", refs: []string{"acc.example/airgap:1.0"}})
	hand := []string{"acc.example/tenant-a:1.0", "acc.example/tenant-b:1.0", "acc.example/tenant-c:1.0"}
	dir := t.TempDir()
	for i, ref := range hand {
		file := fmt.Sprintf("hand%d.tar", i)
		writeArchive(t, dir, archiveCase{file: file, refs: []string{ref}})
		n.ctrImport(filepath.Join(dir, file))
	}
	var used atomic.Int64
	used.Store(10)
	rec := &recorder{}
	cfg := agentimages.Config{Reporter: rec, MaxWorkloadImages: 2, StateFile: filepath.Join(t.TempDir(), "state.json"),
		ImagefsUsage: func(context.Context) (agentimages.DiskUsage, error) {
			return agentimages.DiskUsage{Path: "/imagefs", Used: used.Load(), Capacity: 100}, nil
		}}
	a, stop := n.startAgent(cfg, agentimages.RunOptions{ReconcileInterval: time.Hour})
	named := func(refs ...string) agentimages.WorkloadImages {
		w := agentimages.WorkloadImages{"acc.example/airgap:1.0": {"DaemonSet kube-system/agent"}}
		for _, ref := range refs {
			w[ref] = []string{"Deployment tenant/" + strings.TrimSuffix(strings.TrimPrefix(ref, "acc.example/"), ":1.0")}
		}
		return w
	}
	workloadPinned := func(ref string) bool {
		src, ours := pinning.OwnPin(n.labels(ref))
		return ours && src == pinning.SourceWorkload && n.pinnedLabel(ref)
	}
	refusal := func(ref, limit string) bool {
		e, ok := rec.event(agentimages.ReasonWorkloadImageRefused, limit)
		return ok && e.Warning && strings.Contains(e.Message, ref) && strings.Contains(e.Message, "Deployment tenant/"+strings.TrimSuffix(strings.TrimPrefix(ref, "acc.example/"), ":1.0"))
	}

	a.SetWorkloadImages(named(hand...))
	n.await(10*time.Second, "tenant-a and tenant-b pinned for their workloads", func() bool { return workloadPinned(hand[0]) && workloadPinned(hand[1]) })
	n.await(10*time.Second, "a refusal of tenant-c naming its Deployment and --max-workload-images 2", func() bool { return refusal(hand[2], "--max-workload-images 2") })
	if n.pinnedLabel(hand[2]) {
		t.Errorf("%s pinned beyond --max-workload-images 2", hand[2])
	}
	if !n.pinnedLabel("acc.example/airgap:1.0") {
		t.Errorf("the archive's image, also a workload's, is not pinned")
	}

	// tenant-b's workload goes while the image filesystem is above the threshold: tenant-c would
	// fit the count, but no new workload pin is set; what is pinned stays.
	used.Store(95)
	a.SetWorkloadImages(named(hand[0], hand[2]))
	n.await(10*time.Second, "tenant-b released", func() bool { return !n.pinnedLabel(hand[1]) })
	n.await(10*time.Second, "a refusal of tenant-c naming the disk threshold", func() bool { return refusal(hand[2], "--fetch-max-disk-usage 85%") })
	if n.pinnedLabel(hand[2]) {
		t.Errorf("%s pinned for a workload while the image filesystem is above the threshold", hand[2])
	}
	if !workloadPinned(hand[0]) || !n.pinnedLabel("acc.example/airgap:1.0") {
		t.Errorf("a full image filesystem unpinned an image pinned before (tenant-a: %v, the archive's: %v)", workloadPinned(hand[0]), n.pinnedLabel("acc.example/airgap:1.0"))
	}

	// Room again: the next sync keeps tenant-c.
	used.Store(10)
	a.SetWorkloadImages(named(hand[0], hand[2]))
	n.await(10*time.Second, "tenant-c pinned once the image filesystem has room", func() bool { return workloadPinned(hand[2]) })
	if got := rec.count(agentimages.ReasonWorkloadImageRefused); got != 2 {
		t.Errorf("%d WorkloadImageRefused Events, want 2 (one per refusal, not one per sync)", got)
	}

	// A lower limit holds back new pins only: both workload pins stay.
	stop()
	cfg.MaxWorkloadImages = 1
	b, stop := n.startAgent(cfg, agentimages.RunOptions{ReconcileInterval: time.Hour})
	defer stop()
	b.SetWorkloadImages(named(hand[0], hand[2]))
	n.await(10*time.Second, "the second agent's sync with the workloads", func() bool {
		return b.Keeper().Keep("sha256:none", []string{hand[2]}, nil)
	})
	if !workloadPinned(hand[0]) || !workloadPinned(hand[2]) {
		t.Errorf("--max-workload-images lowered to 1 unpinned a workload's image (tenant-a: %v, tenant-c: %v)", workloadPinned(hand[0]), workloadPinned(hand[2]))
	}
}

// TestWorkloadImageBytesLimit (issue "Trust", item 2): --max-workload-image-bytes holds back a
// workload's image present on the node whose bytes go beyond it, and stops the fetch of one named
// by digest as soon as its manifest tells its size: a WorkloadImageRefused Event naming the
// image, its workload and the limit, before any of its blobs was served.
func TestWorkloadImageBytesLimit(t *testing.T) {
	n := newNode(t)
	dir := t.TempDir()
	hand := []string{"acc.example/tenant-a:1.0", "acc.example/tenant-b:1.0"}
	for i, ref := range hand {
		file := fmt.Sprintf("hand%d.tar", i)
		writeArchive(t, dir, archiveCase{file: file, refs: []string{ref}})
		n.ctrImport(filepath.Join(dir, file))
	}
	sizes := map[string]int64{}
	for _, ref := range hand {
		stored, err := n.client.ImageService().Get(n.ctx, ref)
		if err != nil {
			t.Fatal(err)
		}
		if sizes[ref], err = stored.Size(n.ctx, n.client.ContentStore(), platforms.Default()); err != nil {
			t.Fatal(err)
		}
	}
	p := newHeldPeer(t)
	big := p.pushRandom(t, "tenant/big:1.0", 4<<20)

	// Room for tenant-a, not for tenant-b beside it.
	limit := sizes[hand[0]] + sizes[hand[1]] - 1
	rec := &recorder{}
	cfg := agentimages.PolicyValues{PinnedWorkloadImages: true, WorkloadNamespaces: []string{"tenant"}, FetchMissingImages: true, FetchMaxDiskUsage: 100,
		MaxWorkloadImageBytes: strconv.FormatInt(limit, 10)}.AgentConfig(agentimages.Config{Reporter: rec})
	a := n.runWith(cfg)
	a.SetWorkloadImages(agentimages.WorkloadImages{
		hand[0]: {"Deployment tenant/a"}, hand[1]: {"Deployment tenant/b"}, big: {"CronJob tenant/big"}})
	n.await(10*time.Second, "tenant-a pinned for its workload", func() bool { return n.pinnedLabel(hand[0]) })
	n.await(10*time.Second, "tenant-b refused for --max-workload-image-bytes", func() bool {
		e, ok := rec.event(agentimages.ReasonWorkloadImageRefused, hand[1])
		return ok && strings.Contains(e.Message, "Deployment tenant/b") && strings.Contains(e.Message, "--max-workload-image-bytes")
	})
	var refusal agentimages.Event
	n.await(30*time.Second, "the fetch of "+big+" refused for --max-workload-image-bytes", func() bool {
		var ok bool
		refusal, ok = rec.event(agentimages.ReasonWorkloadImageRefused, "not fetched")
		return ok
	})
	t.Logf("event: %s", refusal.Message)
	if !strings.Contains(refusal.Message, "CronJob tenant/big") || !strings.Contains(refusal.Message, "--max-workload-image-bytes") {
		t.Errorf("the refusal does not name the workload and the limit: %s", refusal.Message)
	}
	if n.pinnedLabel(hand[1]) || n.target(big) != "" {
		t.Errorf("beyond --max-workload-image-bytes: tenant-b pinned %v, %s pulled %v", n.pinnedLabel(hand[1]), big, n.target(big) != "")
	}
	if p.held.Load() == 0 {
		t.Errorf("no blob was asked for: the fetch was refused before it started, not on its manifest")
	}
}
