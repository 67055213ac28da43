package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/cluster"
)

// reporterFor is the Node reporter run uses with --kubeconfig or --in-cluster; without either none,
// and protection stays node-local.
func reporterFor(o *options) (*cluster.Node, error) {
	switch {
	case o.kubeconfig == "" && !o.inCluster:
		return nil, nil
	case o.kubeconfig != "" && o.inCluster:
		return nil, fmt.Errorf("--kubeconfig %s and --in-cluster: give one", o.kubeconfig)
	}
	node := o.nodeName
	switch {
	case node == "" && o.inCluster:
		// A pod's host name is the pod's, not its node's: reporting on it would fail, or worse.
		return nil, fmt.Errorf("--in-cluster needs --node-name (NODE_NAME; the DaemonSet sets it from the pod's spec.nodeName)")
	case node == "":
		var err error
		if node, err = cluster.NodeName(); err != nil {
			return nil, fmt.Errorf("--node-name not given and no host name: %w", err)
		}
	}
	r, err := cluster.ForKubeconfig(o.kubeconfig, node)
	if err != nil {
		if o.inCluster {
			return nil, fmt.Errorf("--in-cluster: %w", err)
		}
		return nil, err
	}
	logrus.Infof("k3s-pinning run: reporting Events and condition %s on node %s", cluster.ConditionType, node)
	return r, nil
}

// statusCluster prints one row per node of the cluster from its condition; it fails (exit 1)
// when any node is not protected.
func statusCluster(ctx context.Context, stdout io.Writer, o *options) error {
	path := o.kubeconfig
	if path == "" {
		path = os.Getenv("KUBECONFIG")
	}
	if path == "" {
		path = cluster.DefaultKubeconfig
	}
	cfg, err := cluster.Config(path)
	if err != nil {
		return cli.Exit(fmt.Sprintf("status --cluster: %v (set --kubeconfig)", err), exitUsage)
	}
	cfg.Timeout = 30 * time.Second
	client, err := cluster.NewClient(cfg)
	if err != nil {
		return cli.Exit(fmt.Sprintf("status --cluster: kubeconfig %s: %v", path, err), exitUsage)
	}
	nodes, err := cluster.NodeStatuses(ctx, client, time.Now())
	if err != nil {
		return cli.Exit(fmt.Sprintf("status --cluster: %v (kubeconfig %s)", err, path), exitUsage)
	}
	unprotected := 0
	for _, n := range nodes {
		if !n.Protected {
			unprotected++
		}
	}
	if o.output == "json" {
		if nodes == nil {
			nodes = []cluster.NodeStatus{}
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Nodes []cluster.NodeStatus `json:"nodes"`
		}{nodes}); err != nil {
			return err
		}
	} else {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NODE\tPROTECTED\tREASON\tSINCE\tMESSAGE")
		for _, n := range nodes {
			since := "-"
			if !n.Since.IsZero() {
				since = time.Since(n.Since).Round(time.Second).String()
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", n.Node, n.Status, n.Reason, since, n.Message)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if unprotected > 0 {
		return cli.Exit(fmt.Sprintf("status --cluster: %d of %d node(s) not protected", unprotected, len(nodes)), exitProblem)
	}
	return nil
}
