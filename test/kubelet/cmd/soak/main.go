// Command soak is `make soak`: the randomized soak of k3s-pinning against a real containerd and
// the kubelet's real DeleteUnusedImages, for -duration (or -rounds), from -seed. It prints every
// step, then the rounds run, the faults injected by kind and the invariant violations, and exits
// 1 if there was any.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/k3s-pinning/k3s-pinning/test/kubelet/soak"
)

func main() {
	seed := flag.Uint64("seed", uint64(time.Now().UnixNano()), "random seed; the same seed replays the same steps")
	duration := flag.Duration("duration", 10*time.Minute, "stop after this long")
	rounds := flag.Int("rounds", 0, "stop after this many steps (0: no bound)")
	settle := flag.Duration("settle", 20*time.Second, "how long the invariant may take to hold again after a step")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	fmt.Printf("soak: seed %d, duration %s, rounds %d\n", *seed, *duration, *rounds)
	res, err := soak.Run(ctx, soak.Options{Seed: *seed, Duration: *duration, Rounds: *rounds, Settle: *settle}, os.Stdout)
	if res != nil {
		res.Print(os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(2)
	}
	if len(res.Violations) > 0 {
		os.Exit(1)
	}
}
