// Package images is the agent side of k3s-pinning: it keeps what the k3s air-gap images dir
// provides (read by package airgap) present and pinned in containerd. The data path, top to
// bottom: archives are read into indexes (airgap), imported with the pin set at creation
// (importer, through pinning.Pinner), recorded (statefile), and the keep-decision (keep.Plan)
// drives reconcile, restore, the adoption of k3s's pins and the kubelet's GC filter (keep.Keeper).
//
// Its files, by concern:
//   - the loader, archive to containerd: import.go (Load), tarball.go (an archive's blobs),
//     layerindex.go (the content store as containerd's import reads it), storecache.go (the stores,
//     listed once, as package imagelist reads the image store), listpull.go (the .txt lists,
//     pulled through the CRI);
//   - the agent: agent.go (Agent, Config), sync.go (Sync), run.go (Run: events, restore, the
//     images dir), fetch.go and pullguard.go (fetching by digest, within the disk's room),
//     imagefs.go, manual.go (pin and unpin), k3spins.go (stock k3s's pins adopted), workloads.go
//     (what the workloads may add), leases.go;
//   - what it keeps and tells: state.go and statelost.go (saving the state, rebuilding a lost one;
//     the file is package statefile's), report.go (Reporter, Events, the protection), inspect.go
//     (Inspect, for status and doctor), metrics.go;
//   - connect.go: the containerd connection, every call bounded;
//   - policyvalues.go: the flags' values and names (the flags themselves are pkg/k3spinning's).
//
// The keep-decision is package keep, the image list imagelist, the state file statefile. It is
// still larger than one package should be: the loader is to become a package of its own.
package images

import (
	"context"
	"maps"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/imagelist"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/keep"
	"github.com/k3s-pinning/k3s-pinning/pkg/agent/statefile"
	"github.com/k3s-pinning/k3s-pinning/pkg/airgap"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// DefaultImagesDir is where k3s loads air-gap images from.
const DefaultImagesDir = "/var/lib/rancher/k3s/agent/images"

// Containerd is what the agent uses of containerd, each part one of containerd's own narrow
// interfaces, so that the agent's logic runs on any implementation of them: a daemon's (Services),
// or containerd's metadata store opened in a test.
type Containerd struct {
	Images  images.Store
	Content content.Store
	Leases  leases.Manager
	// CRI pulls the entries of .txt lists (so registry mirrors and credentials apply); nil: lists
	// fail with an error naming the file.
	CRI runtimeapi.ImageServiceClient
	// Events are the image events Run follows; nil: Run reconciles on its period only.
	Events Events
}

// Events is containerd's event stream and whether containerd answers (a *containerd.Client).
type Events interface {
	Subscribe(ctx context.Context, filters ...string) (<-chan *events.Envelope, <-chan error)
	IsServing(ctx context.Context) (bool, error)
}

// Services are the parts of a containerd daemon the agent uses, all on client's connection: the
// CRI image service too, since containerd serves it on its own socket.
func Services(client *containerd.Client) Containerd {
	cd := Containerd{Images: client.ImageService(), Content: client.ContentStore(), Leases: client.LeasesService(), Events: client}
	if conn, ok := client.Conn().(*grpc.ClientConn); ok {
		cd.CRI = runtimeapi.NewImageServiceClient(conn)
		cd.Images = imagelist.NewStore(cd.Images, conn)
	}
	return cd
}

// Config is what the agent protects: the images dir, the policy beyond it, and k3s's retag
// registries.
type Config struct {
	ImagesDir       string
	Policy          *pinning.Policy
	ExtraRegistries []string
	// StateFile keeps what each archive provided across restarts (statefile.DefaultPath for the
	// daemon). Empty: the state lives in memory only, and each process starts by re-indexing.
	StateFile string
	// Reporter, when set, is told the agent's events and the node's protection (the cluster
	// package: Events and a condition on the Node).
	Reporter Reporter
	// Fetch fetches a wanted image that is missing and that no archive here provides, by
	// digest, through the CRI (PolicyValues.FetchMissingImages); FetchMaxDiskUsage bounds it.
	Fetch             bool
	FetchMaxDiskUsage int
	// RetainRemoved keeps what a removed archive provided (PolicyValues.RetainRemovedArchiveImages).
	RetainRemoved bool
	// MaxWorkloadImages bounds the references kept for workloads alone (0: DefaultMaxWorkloadImages),
	// MaxWorkloadImageBytes their images' bytes (0: no bound).
	MaxWorkloadImages     int
	MaxWorkloadImageBytes int64
	// ImagefsUsage says how full the image filesystem is; nil: the CRI's ImageFsInfo mount
	// point, measured with statfs, as the kubelet measures it.
	ImagefsUsage func(ctx context.Context) (DiskUsage, error)
}

// AgentConfig is the part of the agent's Config these values set.
func (v PolicyValues) AgentConfig(cfg Config) Config {
	cfg.Fetch, cfg.RetainRemoved, cfg.FetchMaxDiskUsage = v.FetchMissingImages, v.RetainRemovedArchiveImages, v.FetchMaxDiskUsage
	cfg.MaxWorkloadImages = v.MaxWorkloadImages
	cfg.MaxWorkloadImageBytes, _ = v.maxWorkloadImageBytes() // checked with the flags
	return cfg
}

// Agent keeps the images of the images dir, and those the policy names, present and pinned. Its
// exported methods may be called from several goroutines, also while Run runs: they take turns.
type Agent struct {
	cd       Containerd
	cfg      Config
	importer *importer
	pinner   *pinning.Pinner
	keeper   *keep.Keeper
	metrics  *agentMetrics
	// digestRefs remembers repo@digest names for the length of a sync or restore.
	digestRefs *keep.DigestRefs

	mu    sync.Mutex // guards what follows
	state *statefile.State
	// present and read are the images dir as last surveyed: archive names, and the indexes read
	// from them (an archive that could not be read is absent from read).
	present []string
	read    map[string]*airgap.Index
	plan    *keep.Plan
	listed  bool // plan was resolved against a containerd list (AdoptK3sPins needs that)
	track   tracker
	// workloadImages are the references the workloads in scope name, normalized, with the
	// workloads naming each; nil: not known. workloads are those of them admitted to the plan
	// (admitWorkloads); refused says why each other one is not, as last reported.
	workloadImages WorkloadImages
	workloads      map[string]bool
	refused        map[string]string
	// workloadBytes are the bytes of the images admitted for workloads alone and present, as of
	// the last admission; sizes remembers image sizes by target for it.
	workloadBytes int64
	sizes         map[digest.Digest]int64
	resync        chan struct{} // a full sync requested (the images dir, containerd, the workloads)
	// agentLock, held open, makes this the one live agent of its state file; importLeasesDone:
	// ownImportLeases has run (it runs once).
	agentLock        *os.File
	importLeasesDone bool
	// toRestore and toFetch are what Run has waiting: restores by archive, fetches by the
	// repo@digest pulled (nil outside Run).
	toRestore map[string]*pendingRestore
	toFetch   map[string]*pendingFetch
	// retainedSeen are the retained references as the state file last had them (reloadRetained).
	retainedSeen map[string]map[string]bool
	// stateLost: the agent started without a state it could read, so the first sync reads back
	// from containerd's pins what was retained (rebuildRetained). stateUnreadable is why, while
	// the unreadable file is still where it was; stateSeen is the file as the agent last read or
	// wrote it (keepAsideUnreadable).
	stateLost       bool
	stateUnreadable error
	stateSeen       os.FileInfo
	// savedWork is what the last save wrote of the agent's waiting work (saveViewChange).
	savedWork statefile.RunStatus
	// pulls are the list entries Run pulls in the background (nil outside Run).
	pulls *listPulls
	// reconciled is when this process's last full sync ended (unix nanoseconds; 0: none yet),
	// read without the lock: a stuck agent holds it.
	reconciled atomic.Int64
}

// NewAgent returns an Agent on cd. The containerd namespace comes from each call's context.
func NewAgent(cd Containerd, cfg Config) *Agent {
	refs := keep.NewDigestRefs()
	a := &Agent{
		cd:  cd,
		cfg: cfg,
		importer: &importer{cd: cd, pinner: pinning.NewPinner(cd.Images), extraRegistries: cfg.ExtraRegistries, digestRefs: refs,
			writerStalled: defaultWriterStalled},
		pinner:     pinning.NewPinner(cd.Images),
		keeper:     &keep.Keeper{},
		metrics:    newMetrics(),
		digestRefs: refs,
		track:      tracker{missing: map[string]bool{}, lost: map[string]bool{}},
		resync:     make(chan struct{}, 1),
	}
	a.openState()
	// Before the first reconcile, every archive recorded is taken as present, so that a kubelet
	// starting beside the agent never sees a gap.
	a.noteRetained()
	a.present, a.read = slices.Collect(maps.Keys(a.state.Archives)), map[string]*airgap.Index{}
	a.plan = a.newPlan(a.present, a.read)
	a.keeper.Publish(a.plan, nil)
	return a
}

// Keeper is the agent's keep-decision for the kubelet's image garbage collector, up to date with
// its last reconcile. Programs that embed the kubelet register it as a GC filter:
//
//	keeper := agent.Keeper()
//	images.RegisterGCFilter("k3s-pinning", func(img container.Image) bool {
//		return keeper.Keep(img.ID, img.RepoTags, img.RepoDigests)
//	})
func (a *Agent) Keeper() *keep.Keeper { return a.keeper }

// Metrics are the agent's Prometheus metrics, for the program to register where it serves them.
func (a *Agent) Metrics() prometheus.Collector { return a.metrics }

// newPlan is the keep-decision for the archives present, with the indexes read from them.
func (a *Agent) newPlan(present []string, read map[string]*airgap.Index) *keep.Plan {
	return keep.New(a.planInput(present, read))
}

// planInput is what the plan for the archives present, with the indexes read from them, is made of.
func (a *Agent) planInput(present []string, read map[string]*airgap.Index) keep.Input {
	return keep.Input{Present: present, Read: read, Recorded: a.state.Archives, Policy: a.cfg.Policy, ExtraRegistries: a.cfg.ExtraRegistries,
		Workloads: a.workloads, Retained: a.state.Retained, DigestRefs: a.digestRefs}
}

// requestSync asks Run for a full sync; requests made while one is pending are one.
func (a *Agent) requestSync() {
	select {
	case a.resync <- struct{}{}:
	default:
	}
}

// SetWorkloadImages sets the images the workloads in scope reference (--pinned-workload-images:
// pod templates of Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs, CronJobs, and Pods),
// as their specs write them, and has Run sync: those admitted within the limits are pinned
// (admitWorkloads), and pins set for a workload no longer there are released. Until it is first
// called, workload pins are kept as they are. A reference that does not parse is skipped.
func (a *Agent) SetWorkloadImages(imgs WorkloadImages) {
	named := make(WorkloadImages, len(imgs))
	for r, owners := range imgs {
		if n, err := reference.ParseDockerRef(r); err == nil {
			named[n.String()] = append(named[n.String()], owners...)
		}
	}
	a.mu.Lock()
	a.workloadImages = named
	a.mu.Unlock()
	logrus.Infof("the workloads in scope name %d image reference(s): reconciling", len(named))
	a.requestSync()
}

// replan makes the plan again from the last survey and the state, after the state changed.
func (a *Agent) replan() { a.plan = a.newPlan(a.present, a.read) }

// View is the agent's own view (last reconcile, restores, failures).
func (a *Agent) View() statefile.RunStatus {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.state.Agent
}
