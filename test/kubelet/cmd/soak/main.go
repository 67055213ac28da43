// Command soak is `make soak`: the randomized soak of k3s-pinning against a real containerd and
// the kubelet's real DeleteUnusedImages, for -duration (or -rounds), from -seed, -runs times
// (each run from the next seed). It prints every step, then per run the rounds run, the faults
// injected by kind and the invariant violations, and last a line for all runs that names every
// failed seed with the command that replays it (so a log cut to its tail still says how). Exits 1
// if any run had a violation, 2 if one could not run.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"time"

	"github.com/k3s-pinning/k3s-pinning/test/kubelet/soak"
)

func main() {
	seed := flag.Uint64("seed", uint64(time.Now().UnixNano()), "random seed of the first run; the same seed replays the same steps")
	duration := flag.Duration("duration", 10*time.Minute, "stop each run after this long")
	rounds := flag.Int("rounds", 0, "stop each run after this many steps (0: no bound)")
	settle := flag.Duration("settle", 20*time.Second, "how long the invariant may take to hold again after a step")
	runs := flag.Int("runs", 1, "runs back to back, from seed, seed+1, ...")
	only := flag.String("faults", "", "comma-separated fault kinds to draw (default: every kind): "+strings.Join(faultNames(), ","))
	flag.Parse()
	var faults []soak.Fault
	for _, f := range strings.FieldsFunc(*only, func(r rune) bool { return r == ',' }) {
		if !slices.Contains(soak.Faults, soak.Fault(f)) {
			fmt.Fprintf(os.Stderr, "soak: -faults: no fault kind %q (kinds: %s)\n", f, strings.Join(faultNames(), ","))
			os.Exit(2)
		}
		faults = append(faults, soak.Fault(f))
	}
	if *runs < 1 {
		fmt.Fprintln(os.Stderr, "soak: -runs must be at least 1")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	replay := func(seed uint64) string {
		flags := fmt.Sprintf("-seed %d -duration %s", seed, *duration)
		if *rounds > 0 {
			flags = fmt.Sprintf("-seed %d -rounds %d", seed, *rounds)
		}
		if *only != "" {
			flags += " -faults " + *only
		}
		return fmt.Sprintf("make soak SOAK_FLAGS='%s'", flags)
	}
	var failed, broken []string
	start, total := time.Now(), 0
	for i := range *runs {
		s := *seed + uint64(i)
		fmt.Printf("soak: run %d of %d: seed %d, duration %s, rounds %d\n", i+1, *runs, s, *duration, *rounds)
		res, err := soak.Run(ctx, soak.Options{Seed: s, Duration: *duration, Rounds: *rounds, Settle: *settle, Faults: faults}, os.Stdout)
		if res != nil {
			res.Print(os.Stdout)
			total += res.Rounds
		}
		switch {
		case err != nil:
			fmt.Fprintf(os.Stderr, "soak: seed %d: %v\n", s, err)
			broken = append(broken, fmt.Sprintf("seed %d (%s)", s, replay(s)))
		case len(res.Violations) > 0:
			failed = append(failed, fmt.Sprintf("seed %d (%s)", s, replay(s)))
		}
		if ctx.Err() != nil {
			break
		}
	}
	fmt.Printf("soak: %d run(s), %d rounds in %s: %d with invariant violations, %d could not run\n", *runs, total, time.Since(start).Round(time.Second), len(failed), len(broken))
	if len(failed)+len(broken) > 0 {
		fmt.Printf("soak FAILED: replay %s\n", strings.Join(append(failed, broken...), "; "))
	}
	if len(broken) > 0 {
		os.Exit(2)
	}
	if len(failed) > 0 {
		os.Exit(1)
	}
}

func faultNames() []string {
	var out []string
	for _, f := range soak.Faults {
		out = append(out, string(f))
	}
	return out
}
