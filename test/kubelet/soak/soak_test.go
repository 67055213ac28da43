package soak_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/k3s-pinning/k3s-pinning/pkg/containerdtest"
	"github.com/k3s-pinning/k3s-pinning/test/kubelet/soak"
)

// TestSoakShort is the short soak of `make test`: SOAK_ROUNDS steps (default 40) from
// SOAK_SEED (default: the time, printed so that a failure can be replayed). `make soak` runs
// the long one.
func TestSoakShort(t *testing.T) {
	containerdtest.RequireRoot(t)
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("SOAK_SEED"); v != "" {
		seed, _ = strconv.ParseUint(v, 10, 64)
	}
	rounds := 40
	if v := os.Getenv("SOAK_ROUNDS"); v != "" {
		rounds, _ = strconv.Atoi(v)
	}
	t.Logf("soak seed %d (replay: SOAK_SEED=%d)", seed, seed)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	res, err := soak.Run(ctx, soak.Options{Seed: seed, Rounds: rounds}, testLog{t})
	if err != nil {
		t.Fatalf("soak seed %d: %v (replay: SOAK_SEED=%d SOAK_ROUNDS=%d)", seed, err, seed, rounds)
	}
	res.Print(testLog{t})
	if len(res.Violations) > 0 {
		// The last line of a failure names the seed: a log cut to its tail still replays it.
		t.Errorf("%d invariant violation(s); replay: SOAK_SEED=%d SOAK_ROUNDS=%d, or make soak SOAK_FLAGS='-seed %d -rounds %d'", len(res.Violations), seed, rounds, seed, rounds)
	}
	if res.Rounds < rounds {
		t.Errorf("ran %d of %d rounds", res.Rounds, rounds)
	}
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) { l.t.Log(string(p)); return len(p), nil }
