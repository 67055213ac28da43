package main

import (
	"context"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestMetricsBarePortIsLoopbackOnly: `--metrics-address :PORT` serves on 127.0.0.1 and not on the
// node's other addresses; exposing metrics takes an explicit address.
func TestMetricsBarePortIsLoopbackOnly(t *testing.T) {
	var external string
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ip, ok := a.(*net.IPNet); ok && !ip.IP.IsLoopback() && ip.IP.To4() != nil {
			external = ip.IP.String()
			break
		}
	}
	if external == "" {
		t.Skip("SKIPPED: this machine has no non-loopback IPv4 address to probe")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go serveHTTP(ctx, ":"+port, prometheus.NewRegistry(), health{started: time.Now(), reconciled: func() time.Time { return time.Time{} }, stallAfter: time.Minute})
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := client.Get("http://127.0.0.1:" + port + "/metrics")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics not served on 127.0.0.1:%s: %v", port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if resp, err := client.Get("http://" + net.JoinHostPort(external, port) + "/metrics"); err == nil {
		resp.Body.Close()
		t.Errorf("metrics answered on %s:%s; a bare :port must listen on loopback only", external, port)
	}
}
