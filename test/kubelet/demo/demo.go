// Package demo is the main job of k3s-pinning on an embedded default: a private containerd, an
// air-gap images dir with archives in several formats, one image imported by hand that nobody
// wants, the k3s-pinning agent, then the kubelet's real image GC with the image filesystem 95%
// full. `make demo` prints its table; the tests assert on the same Result.
package demo

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/klog/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
	"github.com/k3s-pinning/k3s-pinning/test/kubelet/kubeletgc"
)

// GCPath is how the kubelet is asked to delete images.
type GCPath string

const (
	// Threshold is the periodic GC when usage passes imageGCHighThresholdPercent.
	Threshold GCPath = "threshold"
	// Eviction is the eviction manager's DeleteUnusedImages under DiskPressure.
	Eviction GCPath = "eviction"
	// MaxAge is the periodic GC removing images unused for longer than imageMaximumGCAge, with
	// the disk well under the threshold.
	MaxAge GCPath = "max-age"
)

// GCPaths are every way the kubelet deletes images.
var GCPaths = []GCPath{Threshold, Eviction, MaxAge}

// Protection is what stands between the air-gap images and the kubelet's GC.
type Protection string

const (
	// None: the archives are imported by hand with `ctr images import`, unpinned, and the kubelet
	// is stock: the failure this project prevents.
	None Protection = "none"
	// CRIPins: the k3s-pinning agent loads the images dir (pinned at creation); stock kubelet.
	CRIPins Protection = "cri-pins"
	// FilterOnly: the agent loads the images dir, then every pin label is stripped (a runtime that
	// lost them); only the kubelet GC filter of patches/kubernetes stands.
	FilterOnly Protection = "filter-only"
	// PinsAndFilter: the agent's pins and the GC filter, as in a patched k3s.
	PinsAndFilter Protection = "pins+filter"
)

// Options choose the scenario.
type Options struct {
	Protection Protection
	Path       GCPath
}

// Row is one reference before and after the GC.
type Row struct {
	Ref     string
	From    string // the archive it came from, or "hand import"
	Wanted  bool   // from the images dir: must survive
	Pinned  bool   // CRI view before the GC
	Before  bool   // listed by the CRI before the GC
	After   bool   // present in containerd after the GC
	ImageID string
}

// Result is what the GC did.
type Result struct {
	Rows    []Row
	GCError error    // the GC's own error (it reports when it cannot free all it wanted)
	Removed []string // the GC's "Removing image" log lines
}

// archives is the embedded air-gap images dir: file name -> what it holds.
var archives = []struct {
	file string
	oci  bool
	refs []string
}{
	{"core-images.tar", false, []string{"airgap.example/core/coredns:1.12.0", "airgap.example/core/metrics-server:0.8.0"}},
	{"apps.tar.zst", true, []string{"airgap.example/apps/web:2.1", "airgap.example/apps/api:1.4"}},
	{"tools.tar.gz", false, []string{"airgap.example/tools/busybox:1.37"}},
}

const unwanted = "registry.example/scratch/debug:0.1"

// Run runs the scenario in a fresh temp dir and removes everything it started on return.
func Run(ctx context.Context, opts Options, log io.Writer) (*Result, error) {
	work, err := os.MkdirTemp("", "k3s-pinning-demo-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	fmt.Fprintf(log, "== building containerd from the go.mod pin (cached after the first run)\n")
	d, err := containerdtest.Start(ctx, work, containerdtest.Options{})
	if err != nil {
		return nil, err
	}
	defer d.Stop()
	fmt.Fprintf(log, "== containerd %s running at %s\n", d.Bin.Version, d.Address)

	imagesDir := filepath.Join(work, "images")
	handDir := filepath.Join(work, "hand")
	for _, dir := range []string{imagesDir, handDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
	}
	from := map[string]string{}
	for _, a := range archives {
		if err := writeArchive(filepath.Join(imagesDir, a.file), a.oci, a.refs); err != nil {
			return nil, err
		}
		for _, r := range a.refs {
			from[r] = a.file
		}
	}
	handArchive := filepath.Join(handDir, "debug.tar")
	if err := writeArchive(handArchive, false, []string{unwanted}); err != nil {
		return nil, err
	}
	from[unwanted] = "hand import"

	client, err := d.Client()
	if err != nil {
		return nil, err
	}
	defer client.Close()
	ctx = namespaces.WithNamespace(ctx, pinning.DefaultNamespace)

	toImport := []string{handArchive}
	var agent *images.Agent
	if opts.Protection == None {
		fmt.Fprintf(log, "== control: archives imported by hand with `ctr images import`, no k3s-pinning\n")
		for _, a := range archives {
			toImport = append(toImport, filepath.Join(imagesDir, a.file))
		}
	} else {
		fmt.Fprintf(log, "== k3s-pinning agent: sync %s\n", imagesDir)
		agent = images.NewAgent(images.Services(client), images.Config{ImagesDir: imagesDir})
		report := agent.Sync(ctx)
		for _, a := range report.Archives {
			fmt.Fprintf(log, "   %-16s %-15s %d references, imported=%t\n", a.Archive.Name(), a.Format, len(a.Refs), a.Imported)
		}
		if err := report.Err(); err != nil {
			return nil, err
		}
	}
	for _, path := range toImport {
		out, err := exec.CommandContext(ctx, d.Bin.Ctr, "-a", d.Address, "-n", pinning.DefaultNamespace, "images", "import", path).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("ctr images import %s: %v\n%s", path, err, out)
		}
	}
	if opts.Protection == FilterOnly {
		fmt.Fprintf(log, "== stripping every pin label: only the kubelet GC filter is left\n")
		if err := containerdtest.StripPins(ctx, client.ImageService()); err != nil {
			return nil, err
		}
	}
	if opts.Protection == FilterOnly || opts.Protection == PinsAndFilter {
		fmt.Fprintf(log, "== kubelet GC filter %q registered\n", kubeletgc.FilterName)
		defer kubeletgc.RegisterFilter(agent.Keeper())()
	}

	cri := runtimeapi.NewImageServiceClient(client.Conn().(*grpc.ClientConn))
	// The CRI's view follows the metadata store by a moment (it learns of an import and of a
	// label from containerd's events); let it settle, as the kubelet would see it minutes after
	// start-up.
	imported := make([]string, 0, len(from))
	for r := range from {
		imported = append(imported, r)
	}
	before, err := settledImages(ctx, cri, imported)
	if err != nil {
		return nil, err
	}

	var gcLog bytes.Buffer
	klog.LogToStderr(false)
	klog.SetOutput(&gcLog)
	defer klog.LogToStderr(true)
	runtime := kubeletgc.NewCRIRuntime(client.Conn().(*grpc.ClientConn))
	disk := &kubeletgc.DiskUsage{Capacity: 1 << 30, UsedPercent: 95}
	policy := kubeletgc.Policy()
	beganGC := time.Now() // one cycle of the periodic loop, right after the kubelet started
	if opts.Path == MaxAge {
		// imageMaximumGCAge 1m, an hour after the kubelet started; the disk half empty
		disk.UsedPercent, policy.MaxAge, beganGC = 50, time.Minute, time.Now().Add(-time.Hour)
	}
	manager, err := kubeletgc.NewManager(runtime, disk, policy)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "== kubelet image GC (%s), image filesystem %d%% full of %d MiB\n", opts.Path, disk.UsedPercent, disk.Capacity>>20)
	res := &Result{}
	switch opts.Path {
	case Eviction:
		res.GCError = manager.DeleteUnusedImages(ctx)
	default:
		res.GCError = manager.GarbageCollect(ctx, beganGC)
	}
	klog.Flush()
	sc := bufio.NewScanner(&gcLog)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "Removing image") {
			res.Removed = append(res.Removed, sc.Text())
		}
	}
	refs := map[string]bool{}
	for r := range from {
		refs[r] = true
	}
	for _, img := range before {
		for _, t := range img.RepoTags {
			refs[t] = true
		}
	}
	for ref := range refs {
		row := Row{Ref: ref, From: from[ref], Wanted: from[ref] != "" && from[ref] != "hand import"}
		if img := findTag(before, ref); img != nil {
			row.Before, row.Pinned, row.ImageID = true, img.Pinned, img.Id
		}
		_, err := client.ImageService().Get(ctx, ref)
		row.After = err == nil
		res.Rows = append(res.Rows, row)
	}
	sort.Slice(res.Rows, func(i, j int) bool { return res.Rows[i].Ref < res.Rows[j].Ref })
	return res, nil
}

func writeArchive(path string, oci bool, refs []string) error {
	// 1-3 MiB of random layer each, as distinct images
	if oci {
		entries := map[string]any{}
		for i, r := range refs {
			var err error
			if i == 0 {
				entries[r], err = imagetest.MultiPlatform(1<<20, imagetest.Amd64, v1.Platform{OS: "linux", Architecture: "arm64"})
			} else {
				entries[r], err = imagetest.Image(int64(i+1)<<20, imagetest.Amd64)
			}
			if err != nil {
				return err
			}
		}
		return imagetest.WriteOCI(path, entries)
	}
	tags := map[string]v1.Image{}
	for i, r := range refs {
		img, err := imagetest.Image(int64(i+1)<<20, imagetest.Amd64)
		if err != nil {
			return err
		}
		tags[r] = img
	}
	return imagetest.WriteDocker(path, tags)
}

func listImages(ctx context.Context, cri runtimeapi.ImageServiceClient) ([]*runtimeapi.Image, error) {
	resp, err := cri.ListImages(ctx, &runtimeapi.ListImagesRequest{})
	if err != nil {
		return nil, err
	}
	return resp.Images, nil
}

// settledImages lists images once the CRI lists every imported reference and two lists a
// moment apart agree on every pinned flag, or after 30 s with what it lists then (the caller
// reports a reference still missing as never imported). On a loaded 2-core CI machine the
// CRI listed the last archive imported by ctr only after the first two lists agreed.
func settledImages(ctx context.Context, cri runtimeapi.ImageServiceClient, imported []string) ([]*runtimeapi.Image, error) {
	prev, err := listImages(ctx, cri)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		cur, err := listImages(ctx, cri)
		if err != nil {
			return nil, err
		}
		if pinnedSet(cur) == pinnedSet(prev) && listsAll(cur, imported) {
			return cur, nil
		}
		prev = cur
	}
	return prev, nil
}

func listsAll(imgs []*runtimeapi.Image, refs []string) bool {
	for _, r := range refs {
		if findTag(imgs, r) == nil {
			return false
		}
	}
	return true
}

func pinnedSet(imgs []*runtimeapi.Image) string {
	var s []string
	for _, i := range imgs {
		s = append(s, fmt.Sprintf("%s=%t", i.Id, i.Pinned))
	}
	sort.Strings(s)
	return strings.Join(s, ",")
}

func findTag(imgs []*runtimeapi.Image, ref string) *runtimeapi.Image {
	for _, img := range imgs {
		for _, t := range img.RepoTags {
			if t == ref {
				return img
			}
		}
	}
	return nil
}

// Print writes the before/after table and the verdict; ok says whether every air-gap image
// survived and the unwanted one was collected.
func (r *Result) Print(w io.Writer) (ok bool) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "IMAGE\tFROM\tPINNED\tBEFORE GC\tAFTER GC")
	kept, wanted, collected := 0, 0, true
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%s\t%s\t%t\t%s\t%s\n", row.Ref, row.From, row.Pinned, presence(row.Before), presence(row.After))
		if row.Wanted {
			wanted++
			if row.After {
				kept++
			}
		} else if row.After {
			collected = false
		}
	}
	tw.Flush()
	fmt.Fprintf(w, "kubelet GC removed %d image(s)", len(r.Removed))
	if r.GCError != nil {
		fmt.Fprintf(w, "; it reported: %v", r.GCError)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "air-gap images kept: %d of %d; unwanted image collected: %t\n", kept, wanted, collected)
	return kept == wanted && collected
}

func presence(b bool) string {
	if b {
		return "present"
	}
	return "DELETED"
}
