package e2e_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/k3s-pinning/k3s-pinning/pkg/imagetest"
	"github.com/k3s-pinning/k3s-pinning/pkg/pinning"
)

// fleetBenchRounds is how many times each side of the fleet row is taken (best and median).
const fleetBenchRounds = 3

// TestFleetBench is make bench's fleet row, on the cluster of make cluster-e2e (k3s-pinning in
// k3s, --embedded-registry): the time for the 51 MiB fleet image to reach two peers (crictl rmi
// on the server and agent-2 at once; both fetch it by digest from agent-1, the only holder left,
// through k3s's embedded registry, and pin it), against `ctr images import` of a 51 MiB archive of
// the same kind (OCI, one random image) on one node, which unpacks it as a CRI pull does.
func TestFleetBench(t *testing.T) {
	if os.Getenv("K3S_FLEET_BENCH") == "" {
		t.Skip("*** SKIPPED: K3S_FLEET_BENCH is not set: make bench runs it ***")
	}
	bin := k3sBinDir(t)
	tools := os.Getenv("K3S_CLUSTER_TOOLS")
	if tools == "" {
		t.Skip("*** SKIPPED: K3S_CLUSTER_TOOLS is not set: make bench builds the nodes' iptables and CNI plugins (build/cluster-tools.sh) and sets it ***")
	}
	c := newCluster(t, patchedCluster, bin, tools)
	c.start()
	agent2 := c.agents()[1]
	peers := []*clusterNode{c.server(), agent2}
	crictl := func(n *clusterNode, args ...string) {
		t.Helper()
		if out, err := n.crictl(args...); err != nil {
			t.Fatalf("%s: crictl %v: %v\n%s", n.name, args, err, out)
		}
	}
	kept := func(n *clusterNode) bool { return n.present(c.shared)[c.shared] && n.criPinned(c.shared) }
	for _, n := range peers {
		n.await(4*time.Minute, n.name+": the fleet image fetched at start", func() bool { return kept(n) })
	}
	var fleet []time.Duration
	for range fleetBenchRounds {
		start := time.Now()
		for _, n := range peers {
			crictl(n, "rmi", c.shared)
		}
		for _, n := range peers {
			n.await(3*time.Minute, n.name+": the fleet image back from agent-1", func() bool { return kept(n) })
		}
		fleet = append(fleet, time.Since(start))
	}

	// The baseline: the same kind of archive imported on one node with ctr, then removed again.
	img, err := imagetest.Image(clusterSharedSize, imagetest.Amd64)
	if err != nil {
		t.Fatal(err)
	}
	const benchRef = "airgap.example/cluster/bench:1.0"
	archive := filepath.Join(agent2.dir, "bench.tar")
	if err := imagetest.WriteOCI(archive, map[string]any{benchRef: v1.Image(img)}); err != nil {
		t.Fatal(err)
	}
	var imports []time.Duration
	for range fleetBenchRounds {
		start := time.Now()
		if out, err := agent2.tool("ctr", "-a", k3sContainerdSocket, "-n", pinning.DefaultNamespace, "images", "import", archive); err != nil {
			t.Fatalf("ctr images import %s: %v\n%s", archive, err, out)
		}
		imports = append(imports, time.Since(start))
		crictl(agent2, "rmi", benchRef)
	}
	best := func(d []time.Duration) time.Duration { return slices.Min(d) }
	median := func(d []time.Duration) time.Duration { s := slices.Sorted(slices.Values(d)); return s[len(s)/2] }
	fmt.Printf("\nFIGURE  VALUE  BASELINE  RATIO  TARGET  MET\n")
	fmt.Printf("fleet: a 51 MiB image to two peers through the embedded registry (fetch by digest, pinned)  %.3f s (median %.3f s, %d rounds)  %.3f s ctr images import on one node (median %.3f s)  %.3f  none set  -\n",
		best(fleet).Seconds(), median(fleet).Seconds(), len(fleet), best(imports).Seconds(), median(imports).Seconds(), best(fleet).Seconds()/best(imports).Seconds())
}
