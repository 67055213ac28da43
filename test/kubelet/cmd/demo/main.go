// Command demo is `make demo`: the kubelet's real image GC against a node whose air-gap images
// were loaded by k3s-pinning. It prints what survived and exits 1 if an air-gap image did not.
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
	res, err := demo.Run(ctx, demo.Options{Agent: true, Path: demo.Threshold}, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
	if !res.Print(os.Stdout) {
		os.Exit(1)
	}
}
