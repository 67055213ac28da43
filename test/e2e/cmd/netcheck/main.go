// Command netcheck is the app of the cluster e2e's images, its proof of the CNI: a pod on one node
// reaches, through a Service, a pod on another. Static (built with CGO_ENABLED=0), so that an
// image of one file runs; apart from the sleeper, whose small size the disk-pressure tests count on.
//
//	netcheck serve ADDR      serves HTTP on ADDR until SIGTERM: every answer is "$NODE_NAME $HOSTNAME"
//	netcheck get URL WANT    asks URL until an answer holds WANT (exit 0), or for 60 s (exit 1)
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	switch {
	case len(os.Args) == 3 && os.Args[1] == "serve":
		host, _ := os.Hostname()
		answer := os.Getenv("NODE_NAME") + " " + host
		http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, answer) })
		go func() { fmt.Fprintln(os.Stderr, http.ListenAndServe(os.Args[2], nil)); os.Exit(1) }()
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
		<-stop
	case len(os.Args) == 4 && os.Args[1] == "get":
		os.Exit(get(os.Args[2], os.Args[3]))
	default:
		fmt.Fprintln(os.Stderr, "usage: netcheck serve ADDR | netcheck get URL WANT")
		os.Exit(2)
	}
}

func get(url, want string) int {
	// A new connection each time: through a Service, each may reach another pod.
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		resp, err := client.Get(url)
		if err != nil {
			fmt.Println(err)
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%s: %s", url, body)
		if strings.Contains(string(body), want) {
			return 0
		}
	}
	return 1
}
