// Command demo is `make demo`: the kubelet's real image GC against a node whose air-gap images
// were loaded by k3s-pinning, first with the agent's CRI pins and the kubelet GC filter (a patched
// k3s), then with every pin label stripped so that the filter alone protects them. It prints what
// survived and exits 1 if an air-gap image did not.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/sirupsen/logrus"

	"github.com/k3s-pinning/k3s-pinning/test/kubelet/demo"
)

func main() {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "make demo needs root: it runs a private containerd (overlayfs snapshotter)")
		os.Exit(2)
	}
	logrus.SetLevel(logrus.WarnLevel) // the table says what was pinned
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ok := true
	for _, p := range []demo.Protection{demo.PinsAndFilter, demo.FilterOnly} {
		fmt.Printf("\n#### protection: %s\n", p)
		res, err := demo.Run(ctx, demo.Options{Protection: p, Path: demo.Threshold}, os.Stdout)
		if err != nil {
			fmt.Fprintln(os.Stderr, "demo:", err)
			os.Exit(1)
		}
		ok = res.Print(os.Stdout) && ok
	}
	if !ok {
		os.Exit(1)
	}
}
