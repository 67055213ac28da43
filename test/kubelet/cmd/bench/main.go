// Command bench is `make bench`: every cost of k3s-pinning against its baseline, measured in the
// same run on a real containerd, printed as one table. Needs root.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/test/kubelet/bench"
)

func main() {
	opts := bench.Defaults
	flag.IntVar(&opts.LargeImages, "large-images", opts.LargeImages, "images of the large set, one archive each")
	flag.Int64Var(&opts.LargeTotal, "large-total", opts.LargeTotal, "total bytes of the large set")
	flag.IntVar(&opts.SmallImages, "small-images", opts.SmallImages, "images of the small set (10 per archive)")
	flag.IntVar(&opts.GCImages, "gc-images", opts.GCImages, "images the kubelet's GC cycle lists, on the small set")
	flag.IntVar(&opts.HugeImages, "huge-images", opts.HugeImages, "references of the huge set (10 per archive); 0 leaves it out")
	flag.IntVar(&opts.HugeGCImages, "huge-gc-images", opts.HugeGCImages, "images the kubelet's GC cycle lists, on the huge set; 0: no cycle")
	flag.DurationVar(&opts.Idle, "idle", opts.Idle, "how long the idle agent is watched")
	flag.IntVar(&opts.Rounds, "rounds", opts.Rounds, "rounds of the cold-start comparison")
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "make bench needs root: it runs private containerds")
		os.Exit(2)
	}
	logrus.SetLevel(logrus.WarnLevel)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	rows, err := bench.Run(ctx, opts, os.Stderr)
	host, _ := os.Hostname()
	fmt.Printf("\nk3s-pinning bench, %s, %s, %d CPUs, %s (%.0f s)\n", time.Now().UTC().Format("2006-01-02"), host, runtime.NumCPU(), runtime.Version(), time.Since(start).Seconds())
	bench.Print(os.Stdout, rows)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}
