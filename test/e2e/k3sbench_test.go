package e2e_test

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// k3sBenchSet is one images dir of make bench's k3s section.
type k3sBenchSet struct {
	name     string
	what     string // as the rows name it
	archives int
	perArch  int   // images per archive
	size     int64 // bytes of random layer per image
	imagefs  int64
}

var k3sBenchSets = []k3sBenchSet{
	{name: "large", what: "20 archives of 51 MiB (1 GiB)", archives: 20, perArch: 1, size: 51 << 20, imagefs: 3 << 30},
	{name: "small", what: "100 archives of 10 small images (1,000 references)", archives: 100, perArch: 10, size: 4 << 10, imagefs: 704 << 20},
	{name: "huge", what: "1,000 archives of 10 small images (10,000 references)", archives: 1000, perArch: 10, size: 4 << 10, imagefs: 1 << 30},
}

// k3sBenchBoot is what one boot of one node measured.
type k3sBenchBoot struct {
	images, ready      time.Duration        // cold boot: every reference present (and pinned, with k3s-pinning); the node Ready
	load               time.Duration        // the load alone: from containerd answering to images
	rss, hwm           float64              // MiB of the k3s process after the load
	writes             uint64               // containerd's metadata transactions from its answering to the load's end
	floor              uint64               // the fewest transactions that leave what the load left (containerdtest.TransactionFloor)
	blobs, records     uint64               // what the load left in containerd: blobs, image records
	ids                uint64               // of the records, the CRI's image ID records (sha256:<config digest>)
	warmCache, warmNew time.Duration        // warm restart to Ready: with .cache.json, and without it
	warmCacheLog       k3sStartLog          // what the warm restart with .cache.json logged
	left               *containerdtest.Load // what the load left, when the boot was asked to keep it
}

// k3sBenchFloor is one boot of the floor: stock k3s on an empty images dir, and what a load with
// k3s-pinning left written from memory as soon as its containerd answers.
type k3sBenchFloor struct {
	images, load time.Duration // from the start of k3s, and from containerd answering, to all of it written
}

// TestK3sBench is make bench's k3s section: the real k3s of make k3s as a single `k3s server`
// node (the k3s e2e's), on the same generated images dir, with k3s-pinning against the same
// binary with --disable-image-pinning (k3s's own import: one archive at a time, .cache.json), in
// the same run, best of K3S_BENCH_ROUNDS (2) boots of each:
//
//   - cold boot: from the start of `k3s server` to every agent/images reference present (and
//     pinned, with k3s-pinning), and to the node Ready (its Ready condition posted by this start);
//   - warm restart (SIGTERM, start again, nothing changed) to Ready, with .cache.json and without,
//     and the first split by its log: to k3s calling the kubelet, to the kubelet running, to Ready;
//   - VmRSS and VmHWM of the k3s process 10 s after the load, with k3s-pinning minus without;
//   - the floor of the cold boot: stock k3s on an empty images dir, and what the first boot with
//     k3s-pinning left in containerd written from memory as soon as its containerd answers
//     (k3sBenchFloorOnce), best of as many boots;
//
// for each set of K3S_BENCH_SETS (large,small,huge). K3S_BENCH_STOCK_BIN (a make k3s
// K3S_WITHOUT_PINNING=1 bin dir) and K3S_BENCH_RELEASE (a dir with the release binary and image
// archive for amd64) add the size rows. The node is Ready once k3s's kubelet reports it: no CNI
// runs (flannel off, as in the k3s e2e); a loopback network config in a dir of the test's own lets
// the CRI report its network ready.
func TestK3sBench(t *testing.T) {
	if os.Getenv("K3S_BENCH") == "" {
		t.Skip("*** SKIPPED: K3S_BENCH is not set: make bench runs it ***")
	}
	bin := k3sBinDir(t)
	rounds := 2
	if v := os.Getenv("K3S_BENCH_ROUNDS"); v != "" {
		var err error
		if rounds, err = strconv.Atoi(v); err != nil || rounds < 1 {
			t.Fatalf("K3S_BENCH_ROUNDS=%q: want a number of rounds, 1 or more", v)
		}
	}
	names := strings.Split(envOr("K3S_BENCH_SETS", "large,small,huge"), ",")
	var rows [][]string
	rows = append(rows, k3sSizeRows(t, bin)...)
	for _, name := range names {
		i := slices.IndexFunc(k3sBenchSets, func(s k3sBenchSet) bool { return s.name == name })
		if i < 0 {
			t.Fatalf("K3S_BENCH_SETS: no set %q (large, small, huge)", name)
		}
		set := k3sBenchSets[i]
		dir, refs := writeK3sBenchSet(t, set)
		boots := map[bool][]k3sBenchBoot{}
		for round := range rounds {
			for _, withPinning := range []bool{true, false} {
				t.Run(fmt.Sprintf("%s/pinning=%t/%d", set.name, withPinning, round+1), func(t *testing.T) {
					boots[withPinning] = append(boots[withPinning], k3sBenchBootOnce(t, bin, withPinning, set, dir, refs, withPinning && round == 0))
				})
				if t.Failed() {
					t.FailNow()
				}
			}
		}
		left := boots[true][0].left
		boots[true][0].left = nil
		var floors []k3sBenchFloor
		for round := range rounds {
			t.Run(fmt.Sprintf("%s/floor/%d", set.name, round+1), func(t *testing.T) {
				floors = append(floors, k3sBenchFloorOnce(t, bin, set, left))
			})
			if t.Failed() {
				t.FailNow()
			}
		}
		rows = append(rows, k3sBenchRows(set, boots[true], boots[false], floors)...)
	}
	var out strings.Builder
	tw := tabwriter.NewWriter(&out, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "FIGURE\tVALUE\tBASELINE\tRATIO\tTARGET\tMET\n")
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	tw.Flush()
	fmt.Printf("\nk3s-pinning bench, k3s section (k3s %s, best of %d boots of each)\n%s", filepath.Base(bin), rounds, out.String())
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// writeK3sBenchSet writes set's archives once (docker and OCI archives alternating) and returns
// their dir and every reference they provide.
func writeK3sBenchSet(t *testing.T, set k3sBenchSet) (string, []string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), set.name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	var refs []string
	for a := range set.archives {
		docker, oci := map[string]v1.Image{}, map[string]any{}
		for i := range set.perArch {
			img, err := imagetest.Image(set.size, imagetest.Amd64)
			if err != nil {
				t.Fatal(err)
			}
			ref := fmt.Sprintf("bench.example/%s/a%04d-img%d:1.0", set.name, a, i)
			docker[ref], oci[ref] = img, img
			refs = append(refs, ref)
		}
		path := filepath.Join(dir, fmt.Sprintf("%s-%04d.tar", set.name, a))
		var err error
		if a%2 == 0 {
			err = imagetest.WriteDocker(path, docker)
		} else {
			err = imagetest.WriteOCI(path, oci)
		}
		if err != nil {
			t.Fatal(err)
		}
		// Whole seconds, as a tar or an rsync without --times' nanoseconds leaves them: stock k3s
		// records an archive's mtime in .cache.json to the second and imports again every
		// archive whose mtime is After the recorded one, so a file with a fraction of a second in
		// its mtime (any file written or copied here) is imported at every start, cache or not.
		// Stock's best, the anchor of the warm restart, is with the cache working.
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		whole := st.ModTime().Truncate(time.Second)
		if err := os.Chtimes(path, whole, whole); err != nil {
			t.Fatal(err)
		}
	}
	return dir, refs
}

// k3sBenchBootOnce boots a fresh node on set (its archives linked into agent/images, an empty
// .cache.json beside them, as k3s's own docs have it), then restarts it twice. With keep, the
// boot keeps what the load left in containerd (k3sBenchBoot.left), read once it is measured.
func k3sBenchBootOnce(t *testing.T, bin string, withPinning bool, set k3sBenchSet, dir string, refs []string, keep bool) k3sBenchBoot {
	n := newK3sHost(t, bin, withPinning, set.imagefs)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(n.imagesDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if err := os.Link(filepath.Join(dir, e.Name()), filepath.Join(n.imagesDir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	cache := filepath.Join(n.imagesDir, ".cache.json")
	if err := os.WriteFile(cache, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	n.benchNetwork()

	var b k3sBenchBoot
	start := n.benchStart()
	answering := time.Now()
	meta := containerdtest.MetadataDB(n.imagefs)
	tx0, err := containerdtest.Transactions(meta)
	if err != nil {
		t.Fatal(err)
	}
	// One image list per check: every 200 ms per 1,000 references, so that the checks cost
	// containerd about as much on the huge set as on the small one (both sides alike).
	every, last := 200*time.Millisecond*time.Duration(max(1, len(refs)/1000)), time.Time{}
	n.await(30*time.Minute, "every reference loaded", func() bool {
		if time.Since(last) < every {
			return false
		}
		last = time.Now()
		return n.loaded(refs)
	})
	b.images, b.load = time.Since(start), time.Since(answering)
	tx, err := containerdtest.Transactions(meta)
	if err != nil {
		t.Fatal(err)
	}
	b.writes = tx - tx0
	if b.floor, b.blobs, b.records, b.ids, err = containerdtest.TransactionFloor(n.ctx, n.client.ContentStore(), n.client.ImageService()); err != nil {
		t.Fatal(err)
	}
	b.ready = n.awaitReady(start)
	time.Sleep(10 * time.Second) // what the load left behind: given back, or not
	mem, err := containerdtest.ProcessMemory(n.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	b.rss, b.hwm = mem.RSS, mem.HWM
	if keep {
		if b.left, err = containerdtest.ReadLoad(n.ctx, n.client.ContentStore(), n.client.ImageService()); err != nil {
			t.Fatalf("reading what the load left: %v", err)
		}
	}
	t.Logf("cold boot: images %s (the load from containerd answering %s), Ready %s, VmRSS %.1f MiB (VmHWM %.1f); containerd's transactions in the load %d (it left %d blobs and %d image records, %d of them the CRI's image IDs)",
		b.images.Round(time.Millisecond), b.load.Round(time.Millisecond), b.ready.Round(time.Millisecond), b.rss, b.hwm, b.writes, b.blobs, b.records, b.ids)

	cold := readK3sStartLog(t, n.log, start)
	n.stop()
	start = n.benchStart()
	b.warmCache = n.awaitReady(start)
	b.warmCacheLog = readK3sStartLog(t, n.log, start)
	n.stop()
	if err := os.Remove(cache); err != nil {
		t.Fatal(err)
	}
	start = n.benchStart()
	b.warmNew = n.awaitReady(start)
	warmNewLog := readK3sStartLog(t, n.log, start)
	if !n.loaded(refs) {
		t.Errorf("after the restart without .cache.json, not every reference is loaded")
	}
	t.Logf("warm restart to Ready: %s with .cache.json, %s without; archives imported again by k3s: %d with .cache.json, %d without",
		b.warmCache.Round(time.Millisecond), b.warmNew.Round(time.Millisecond), b.warmCacheLog.imports, warmNewLog.imports)
	for _, r := range []struct {
		what  string
		log   k3sStartLog
		ready time.Duration
	}{{"with .cache.json", b.warmCacheLog, b.warmCache}, {"without .cache.json", warmNewLog, b.warmNew}} {
		t.Logf("warm restart %s: the kubelet called %s-%s after the start (agent/images loaded), running %s after it (once the API server was ready), Ready %s after it",
			r.what, r.log.calledFrom.Round(time.Millisecond), r.log.calledBy.Round(time.Millisecond), r.log.running.Round(time.Millisecond), r.ready.Round(time.Millisecond))
	}
	if withPinning {
		t.Logf("k3s-pinning's start-up sync, before k3s calls the kubelet: %s at the cold boot, %s and %s at the restarts",
			cold.sync, b.warmCacheLog.sync, warmNewLog.sync)
	}
	n.stop()
	return b
}

// benchNetwork gives the node the CRI network config of the bench: a loopback network in a dir of
// its own, so that the CRI reports its network ready and the node goes Ready without a CNI.
func (n *k3sServer) benchNetwork() {
	cni := filepath.Join(n.dir, "cni")
	n.writeFile(filepath.Join(cni, "net.d", "10-bench.conflist"), `{"cniVersion": "1.0.0", "name": "bench", "plugins": [{"type": "loopback"}]}`+"\n")
	n.writeFile(filepath.Join(n.data, "agent", "etc", "containerd", "config-v3.toml.tmpl"), k3sContainerdTemplate+fmt.Sprintf(`
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dir = %q
  conf_dir = %q
`, filepath.Join(cni, "bin"), filepath.Join(cni, "net.d")))
}

// k3sBenchFloorOnce boots the floor of set's cold boot: stock k3s (--disable-image-pinning) on an
// empty images dir, and as soon as its containerd answers, what a load with k3s-pinning left
// (every blob with its labels, every image record) written from memory, as many writes in flight
// as the node has cores (k3s-pinning's load: an archive per core). Nothing is read from an archive
// and nothing hashed on the writer's side, and k3s starts beside it as it does beside a load: a
// load that leaves the same records through containerd's API takes about this long at least.
func k3sBenchFloorOnce(t *testing.T, bin string, set k3sBenchSet, left *containerdtest.Load) k3sBenchFloor {
	n := newK3sHost(t, bin, false, set.imagefs)
	if err := os.MkdirAll(n.imagesDir, 0o755); err != nil {
		t.Fatal(err)
	}
	n.benchNetwork()
	var f k3sBenchFloor
	start := n.benchStart()
	answering := time.Now()
	// Answering is its socket accepting: the first call may still wait on its plugins, as the
	// load's first does.
	n.await(5*time.Minute, "containerd of k3s serving", func() bool {
		_, err := n.client.Version(n.ctx)
		return err == nil
	})
	if err := left.Write(n.ctx, n.client.ContentStore(), n.client.ImageService(), n.client.LeasesService(), runtime.GOMAXPROCS(0)); err != nil {
		t.Fatalf("writing the floor of %s: %v", set.what, err)
	}
	f.images, f.load = time.Since(start), time.Since(answering)
	t.Logf("floor boot: %d blobs (%d MiB) and %d image records written %s after the start of k3s, %s after containerd answered",
		len(left.Blobs), left.Bytes()>>20, len(left.Images), f.images.Round(time.Millisecond), f.load.Round(time.Millisecond))
	n.stop()
	return f
}

// k3sStartLog is what one start's log says about its way to the kubelet.
type k3sStartLog struct {
	imports int    // archives stock k3s's import read ("Importing images from ")
	sync    string // k3s-pinning's start-up sync as k3spinning.Start logs it ("... loaded and pinned in 12ms; ...")
	// k3s called the kubelet between calledFrom and calledBy after the start: containerd is up and
	// agent/images loaded (k3s-pinning's sync or k3s's own import ended; k3s logs "Running
	// kubelet" then). running is when the kubelet runs ("Kubelet version"): it also waits for the
	// API server to be ready, which k3s asks every 2 s (GET /readyz, k3s pkg/util/api.go, from
	// before containerd starts). From the klog lines of the log (microseconds, this host's clock)
	// and k3s's own (whole seconds): the call lies between the lines around "Running kubelet",
	// within that line's second. Zero when not logged.
	calledFrom, calledBy, running time.Duration
}

// readK3sStartLog reads the log of the start at start.
func readK3sStartLog(t *testing.T, log string, start time.Time) k3sStartLog {
	t.Helper()
	data, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	l := k3sStartLog{imports: strings.Count(text, "Importing images from "), sync: "(not logged)"}
	if _, after, found := strings.Cut(text, " loaded and pinned in "); found {
		if took, _, _ := strings.Cut(after, ";"); len(took) <= 20 {
			l.sync = took
		}
	}
	var before time.Time // the last klog line so far
	calling := false
	for line := range strings.Lines(text) {
		if !calling && strings.Contains(line, `level=info msg="Running kubelet `) {
			sec, ok := logrusTime(line)
			if !ok {
				break
			}
			calling = true
			l.calledFrom, l.calledBy = sec.Sub(start), sec.Add(time.Second).Sub(start)
			if before.After(sec) {
				l.calledFrom = before.Sub(start)
			}
			continue
		}
		at, ok := klogTime(line, start)
		if !ok {
			continue
		}
		before = at
		if calling && at.Sub(start) < l.calledBy {
			l.calledBy = at.Sub(start)
		}
		if calling && strings.Contains(line, `"Kubelet version"`) {
			l.running = at.Sub(start)
			break
		}
	}
	return l
}

// logrusTime is the time of a line k3s logs itself (time="2026-12-07T12:59:29Z" ...): whole
// seconds.
func logrusTime(line string) (time.Time, bool) {
	_, after, found := strings.Cut(line, `time="`)
	value, _, closed := strings.Cut(after, `"`)
	if !found || !closed {
		return time.Time{}, false
	}
	at, err := time.Parse(time.RFC3339, value)
	return at, err == nil
}

// klogTime is the time of a klog line ("I1207 12:59:29.768352  11459 server.go:541] ..."), which
// gives no year: the one that puts it nearest near.
func klogTime(line string, near time.Time) (time.Time, bool) {
	if len(line) < 21 || !strings.ContainsRune("IWEF", rune(line[0])) {
		return time.Time{}, false
	}
	at, err := time.ParseInLocation("0102 15:04:05.000000", line[1:21], time.Local)
	if err != nil {
		return time.Time{}, false
	}
	at = at.AddDate(near.Year(), 0, 0)
	if at.Sub(near) > 180*24*time.Hour {
		at = at.AddDate(-1, 0, 0)
	} else if near.Sub(at) > 180*24*time.Hour {
		at = at.AddDate(1, 0, 0)
	}
	return at, true
}

// benchStart starts `k3s server` with the node's arguments, and nothing else: k3s-pinning's
// defaults, or --disable-image-pinning. It returns when k3s started.
func (n *k3sServer) benchStart() time.Time {
	n.t.Helper()
	start := n.launch(n.k3sServerArgs())
	n.awaitContainerd(5 * time.Minute)
	return start
}

// loaded says whether containerd holds every ref, each pinned when k3s-pinning runs; from one
// list of the image store.
func (n *k3sServer) loaded(refs []string) bool {
	imgs, err := n.client.ImageService().List(n.ctx)
	if err != nil {
		return false
	}
	pinned := map[string]bool{}
	for _, img := range imgs {
		pinned[img.Name] = img.Labels[pinning.LabelPinned] == pinning.PinnedValue
	}
	for _, ref := range refs {
		if p, ok := pinned[ref]; !ok || n.pinning && !p {
			return false
		}
	}
	return true
}

// awaitReady waits until the node is Ready by a status the kubelet of the start at start posted
// (the Node keeps the previous run's Ready until then), and returns the time since start. It reads
// the Node from the API server every 50 ms: polling kubectl (a process per look) gave steps of
// about 0.4 s, coarser than the warm restarts' differences.
func (n *k3sServer) awaitReady(start time.Time) time.Duration {
	n.t.Helper()
	api := n.apiClient()
	n.awaitEvery(30*time.Minute, 50*time.Millisecond, "the node Ready", func() bool { return n.readySince(api, start) })
	return time.Since(start)
}

// apiClient is an HTTPS client of the node's API server (127.0.0.1:6443, as the kubeconfig k3s
// writes has it) with k3s's admin client certificate.
func (n *k3sServer) apiClient() *http.Client {
	n.t.Helper()
	tlsDir := filepath.Join(n.data, "server", "tls")
	cert, err := tls.LoadX509KeyPair(filepath.Join(tlsDir, "client-admin.crt"), filepath.Join(tlsDir, "client-admin.key"))
	if err != nil {
		n.t.Fatal(err)
	}
	ca, err := os.ReadFile(filepath.Join(tlsDir, "server-ca.crt"))
	if err != nil {
		n.t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(ca) {
		n.t.Fatalf("no certificate in %s", filepath.Join(tlsDir, "server-ca.crt"))
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: roots},
	}}
}

// readySince says whether the Node's Ready condition is True with a heartbeat at or after since.
// Heartbeats are whole seconds: one in since's own second can only be the previous k3s's (no
// kubelet of this start posts that soon), so it is before since, not counted.
func (n *k3sServer) readySince(api *http.Client, since time.Time) bool {
	resp, err := api.Get("https://127.0.0.1:6443/api/v1/nodes/" + k3sNodeName)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var node struct {
		Status struct {
			Conditions []struct {
				Type, Status      string
				LastHeartbeatTime time.Time
			}
		}
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&node) != nil {
		return false
	}
	for _, c := range node.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True" && !c.LastHeartbeatTime.Before(since)
		}
	}
	return false
}

// k3sBenchRows are the rows of set: the best boot of each side, against its targets.
func k3sBenchRows(set k3sBenchSet, with, stock []k3sBenchBoot, floors []k3sBenchFloor) [][]string {
	best := func(bs []k3sBenchBoot, f func(k3sBenchBoot) time.Duration) time.Duration {
		return slices.Min(mapBoots(bs, f))
	}
	least := func(bs []k3sBenchBoot, f func(k3sBenchBoot) float64) float64 {
		v := make([]float64, len(bs))
		for i, b := range bs {
			v[i] = f(b)
		}
		return slices.Min(v)
	}
	secs := func(d time.Duration) string { return fmt.Sprintf("%.3f s", d.Seconds()) }
	ratio := func(a, b time.Duration) string { return fmt.Sprintf("%.3f", a.Seconds()/b.Seconds()) }
	met := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "NO"
	}
	images := func(b k3sBenchBoot) time.Duration { return b.images }
	load := func(b k3sBenchBoot) time.Duration { return b.load }
	ready := func(b k3sBenchBoot) time.Duration { return b.ready }
	warmCache := func(b k3sBenchBoot) time.Duration { return b.warmCache }
	warmNew := func(b k3sBenchBoot) time.Duration { return b.warmNew }
	wi, si := best(with, images), best(stock, images)
	wr, sr := best(with, ready), best(stock, ready)
	wl, sl := best(with, load), best(stock, load)
	stockWarm := best(stock, warmCache)
	fi := slices.Min(mapFloors(floors, func(f k3sBenchFloor) time.Duration { return f.images }))
	fl := slices.Min(mapFloors(floors, func(f k3sBenchFloor) time.Duration { return f.load }))
	rows := [][]string{
		{"k3s cold boot to images loaded (pinned): " + set.what, secs(wi), secs(si) + " stock k3s", ratio(wi, si), "<= 0.5", met(wi.Seconds() <= 0.5*si.Seconds())},
		{"  its floor: what the load left, written from memory as stock k3s boots (nothing read or hashed by the writer): " + set.what,
			fmt.Sprintf("%s (the boot %.2fx it)", secs(fi), wi.Seconds()/fi.Seconds()), secs(si) + " stock k3s", ratio(fi, si), "-", "-"},
		{"k3s cold boot, the load alone (containerd answering to images loaded): " + set.what, secs(wl), secs(sl) + " stock k3s", ratio(wl, sl), "-", "-"},
		{"  its floor (containerd answering to all of it written): " + set.what,
			fmt.Sprintf("%s (the load %.2fx it)", secs(fl), wl.Seconds()/fl.Seconds()), secs(sl) + " stock k3s", ratio(fl, sl), "-", "-"},
		{"k3s cold boot to node Ready: " + set.what, secs(wr), secs(sr) + " stock k3s", ratio(wr, sr), "-", "-"},
	}
	// The warm restart with .cache.json split by its log (k3sStartLog), best of each side for each
	// part. k3s-pinning's sync ends before k3s calls the kubelet, and the kubelet then waits for
	// k3s's poll to find the API server ready, which on a server node comes seconds after our
	// sync, so the sync is on the way to Ready only where the API server is ready first (an agent
	// node whose server is up: not measured).
	split := []struct {
		what string
		f    func(k3sBenchBoot) time.Duration
	}{
		{"  its start to k3s calling the kubelet, at the latest (containerd up, agent/images loaded)", func(b k3sBenchBoot) time.Duration { return b.warmCacheLog.calledBy }},
		{"  its start to the kubelet running (it waits for the API server to be ready)", func(b k3sBenchBoot) time.Duration { return b.warmCacheLog.running }},
		{"  the kubelet running to the node Ready", func(b k3sBenchBoot) time.Duration {
			if b.warmCacheLog.running == 0 {
				return 0
			}
			return b.warmCache - b.warmCacheLog.running
		}},
	}
	for i, w := range []struct {
		what string
		f    func(k3sBenchBoot) time.Duration
	}{{"with .cache.json", warmCache}, {"without .cache.json", warmNew}} {
		ws, ss := best(with, w.f), best(stock, w.f)
		rows = append(rows, []string{"k3s warm restart to Ready, " + w.what + ": " + set.what, secs(ws), secs(ss) + " stock k3s (its best with .cache.json " + secs(stockWarm) + ")",
			ratio(ws, stockWarm), "<= stock's best", met(ws <= stockWarm)})
		if i > 0 {
			continue // the log splits the restart with .cache.json only
		}
		for _, p := range split {
			ws, ss := best(with, p.f), best(stock, p.f)
			if ws <= 0 || ss <= 0 {
				rows = append(rows, []string{p.what + ": " + set.what, "(not logged)", "-", "-", "-", "-"})
				continue
			}
			rows = append(rows, []string{p.what + ": " + set.what, secs(ws), secs(ss) + " stock k3s", ratio(ws, ss), "-", "-"})
		}
	}
	// What the load's time follows: containerd's metadata transactions (one sync of the disk
	// each), ours against stock k3s's, and a floor for any load through containerd's API that
	// leaves k3s's records: a blob's ingest opened and committed (two), an image record created
	// with its labels (one), nothing labelled after, no lease (a name created without the CRI's
	// "managed" label costs the CRI's update besides, as stock k3s's do).
	tx := func(b k3sBenchBoot) float64 { return float64(b.writes) }
	wt, st := least(with, tx), least(stock, tx)
	txFloor := least(append(slices.Clone(with), stock...), func(b k3sBenchBoot) float64 { return float64(b.floor) })
	rows = append(rows,
		[]string{"containerd transactions of the cold load: " + set.what, fmt.Sprintf("%.0f", wt), fmt.Sprintf("%.0f stock k3s", st), fmt.Sprintf("%.3f", wt/st), "-", "-"},
		[]string{"their floor (2 per blob, 1 per image record): " + set.what, fmt.Sprintf("%.0f", txFloor), fmt.Sprintf("%.0f stock k3s", st), fmt.Sprintf("%.3f", txFloor/st), "-", "-"})
	rss := least(with, func(b k3sBenchBoot) float64 { return b.rss }) - least(stock, func(b k3sBenchBoot) float64 { return b.rss })
	hwm := least(with, func(b k3sBenchBoot) float64 { return b.hwm }) - least(stock, func(b k3sBenchBoot) float64 { return b.hwm })
	rows = append(rows,
		[]string{"k3s memory added after the load (VmRSS, with minus stock): " + set.what, fmt.Sprintf("%+.1f MiB", rss),
			fmt.Sprintf("%.1f MiB stock k3s", least(stock, func(b k3sBenchBoot) float64 { return b.rss })), "-", "<= 32 MiB", met(rss <= 32)},
		[]string{"k3s peak memory added by the load (VmHWM, with minus stock): " + set.what, fmt.Sprintf("%+.1f MiB", hwm),
			fmt.Sprintf("%.1f MiB stock k3s", least(stock, func(b k3sBenchBoot) float64 { return b.hwm })), "-", "<= 64 MiB", met(hwm <= 64)})
	return rows
}

func mapFloors(fs []k3sBenchFloor, f func(k3sBenchFloor) time.Duration) []time.Duration {
	out := make([]time.Duration, len(fs))
	for i, fb := range fs {
		out[i] = f(fb)
	}
	return out
}

func mapBoots(bs []k3sBenchBoot, f func(k3sBenchBoot) time.Duration) []time.Duration {
	out := make([]time.Duration, len(bs))
	for i, b := range bs {
		out[i] = f(b)
	}
	return out
}

// k3sSizeRows: the k3s binary with k3s-pinning against the same build without it, and the
// release's k3s-pinning binary and amd64 image archive, when make bench gave their paths.
func k3sSizeRows(t *testing.T, bin string) [][]string {
	t.Helper()
	size := func(path string) int64 {
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return st.Size()
	}
	mb := func(n int64) string { return fmt.Sprintf("%.1f MB", float64(n)/1e6) }
	var rows [][]string
	if stock := os.Getenv("K3S_BENCH_STOCK_BIN"); stock != "" {
		with, without := size(filepath.Join(bin, "k3s")), size(filepath.Join(stock, "k3s"))
		added := float64(with-without) / float64(without)
		ok := "NO"
		if added <= 0.05 {
			ok = "yes"
		}
		rows = append(rows, []string{"k3s binary with k3s-pinning (go build ./cmd/server, -w -s as k3s)", mb(with), mb(without) + " the same build without k3s-pinning",
			fmt.Sprintf("%.3f", float64(with)/float64(without)), "<= 1.05", ok})
	}
	if rel := os.Getenv("K3S_BENCH_RELEASE"); rel != "" {
		rows = append(rows, []string{"k3s-pinning binary, linux/amd64 (make release: static, -s -w)", mb(size(filepath.Join(rel, "k3s-pinning-linux-amd64"))), "-", "-", "-", "-"})
		img := size(filepath.Join(rel, "k3s-pinning-image-amd64.tar"))
		ok := "NO"
		if img <= 25e6 {
			ok = "yes"
		}
		rows = append(rows, []string{"k3s-pinning-image-amd64.tar (make release, one architecture)", mb(img), "-", "-", "<= 25 MB", ok})
		rows = append(rows, []string{"k3s-pinning-image.tar (make release, amd64, arm64 and arm)", mb(size(filepath.Join(rel, "k3s-pinning-image.tar"))), "-", "-", "-", "-"})
	}
	return rows
}

// TestReadK3sStartLog reads the lines of a warm restart's log that the bench splits it by (as a
// k3s master 469d009fb log of 2026-12-07 has them, with k3s-pinning), across a year's end: klog
// gives no year, k3s's own lines no fraction of a second.
func TestReadK3sStartLog(t *testing.T) {
	start := time.Date(2026, 12, 31, 23, 59, 57, 500_000_000, time.Local)
	k3sLine := func(after time.Duration, msg string) string {
		return fmt.Sprintf("time=%q level=info msg=%q\n", start.Add(after).Truncate(time.Second).Format(time.RFC3339), msg)
	}
	klogLine := func(after time.Duration, rest string) string {
		return "I" + start.Add(after).Format("0102 15:04:05.000000") + "   10498 " + rest + "\n"
	}
	lines := k3sLine(0, "Starting k3s v1.36.3+k3s-pinning-98a29729 (98a29729)") +
		klogLine(1019077*time.Microsecond, "options.go:263] external host was not specified, using 192.0.2.2") +
		k3sLine(1600*time.Millisecond, "k3s-pinning: /data/agent/images loaded and pinned in 14ms; following it") +
		k3sLine(1600*time.Millisecond, "Running kubelet --config-dir=/data/agent/etc/kubelet.conf.d") +
		klogLine(2077618*time.Microsecond, `dynamic_cafile_content.go:161] "Starting controller" name="request-header::/data/server/tls/request-header-ca.crt"`) +
		k3sLine(4600*time.Millisecond, "Importing images from /data/agent/images/a.tar") +
		klogLine(5045521*time.Microsecond, `server.go:541] "Kubelet version" kubeletVersion="v1.36.3+k3s-pinning-98a29729"`) +
		klogLine(5286619*time.Microsecond, `server.go:1280] "Started kubelet"`)
	log := filepath.Join(t.TempDir(), "k3s.log")
	if err := os.WriteFile(log, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	got := readK3sStartLog(t, log, start)
	// The call: after 23:59:59 (k3s's line's second; the klog line before it is earlier), by the
	// klog line after it.
	want := k3sStartLog{imports: 1, sync: "14ms", calledFrom: 1500 * time.Millisecond, calledBy: 2077618 * time.Microsecond, running: 5045521 * time.Microsecond}
	if got != want {
		t.Errorf("readK3sStartLog = %+v, want %+v\n%s", got, want, lines)
	}

	// No klog line between the call and the kubelet running (the API server was ready first, and
	// quiet): the call was within k3s's line's second.
	quiet := k3sLine(0, "Starting k3s v1.36.3+k3s-pinning-98a29729 (98a29729)") +
		k3sLine(1600*time.Millisecond, "Running kubelet --config-dir=/data/agent/etc/kubelet.conf.d") +
		klogLine(5045521*time.Microsecond, `server.go:541] "Kubelet version" kubeletVersion="v1.36.3+k3s-pinning-98a29729"`)
	if err := os.WriteFile(log, []byte(quiet), 0o644); err != nil {
		t.Fatal(err)
	}
	got = readK3sStartLog(t, log, start)
	want = k3sStartLog{sync: "(not logged)", calledFrom: 1500 * time.Millisecond, calledBy: 2500 * time.Millisecond, running: 5045521 * time.Microsecond}
	if got != want {
		t.Errorf("readK3sStartLog = %+v, want %+v\n%s", got, want, quiet)
	}
}
