// Command sleeper is the one program of the e2e test images: the sandbox's pause process and the
// static pod's container. It sleeps until it is told to stop. Static, so that an image of one
// file runs.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
