package main

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"
)

// socketCheckInterval is how often `run` looks whether containerd's socket was replaced.
const socketCheckInterval = 2 * time.Second

// watchSocketReplaced returns an error once the socket at address has no name left: a socket
// bind-mounted alone (the DaemonSet mounts containerd's socket, not its state dir) keeps the
// inode it was mounted with, which containerd unlinks when it restarts and makes a new one. No
// reconnect can reach the new one through that mount; a new container gets it, so `run` exits
// for the kubelet to start one. A socket reached by its path (the daemon on the host) always
// has its name.
func watchSocketReplaced(ctx context.Context, address string, every time.Duration) error {
	ticker := time.NewTicker(every)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
		fi, err := os.Stat(address)
		if err != nil {
			continue // gone for now: the reconnect waits for it
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink == 0 {
			return fmt.Errorf("containerd's socket %s was replaced (containerd restarted), and this mount of it cannot reach the new one: exiting, for a restart to mount it again", address)
		}
	}
}
