package k3spinning_test

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/k3spinning"
)

// A k3s command gets the k3s-pinning flags appended to its own; once the command line (or
// K3S_ variables, or config.yaml) is parsed, the settings hold their values, checked.
func ExampleFlags() {
	var settings k3spinning.Settings
	app := &cli.App{
		Name: "k3s",
		Commands: []*cli.Command{{
			Name:  "agent",
			Flags: k3spinning.Flags(&settings, "K3S"),
			Action: func(*cli.Context) error {
				fmt.Println("pinned images:", settings.PinnedImages)
				fmt.Println("restore:", !settings.DisableImageRestore)
				return nil
			},
		}},
	}
	if err := app.Run([]string{"k3s", "agent", "--pinned-images", "registry.local/*"}); err != nil {
		fmt.Println(err)
	}
	// A bad value stops the command before its action runs, naming the flag.
	if err := app.Run([]string{"k3s", "agent", "--pinned-images", "registry.local/[x"}); err != nil {
		fmt.Println("error:", err)
	}
	// Output:
	// pinned images: [registry.local/*]
	// restore: true
	// error: --pinned-images "registry.local/[x": bad glob: syntax error in pattern
}

// What k3s's agent start runs in place of its own import of agent/images (the patch's
// pkg/agent/containerd/k3s_pinning.go): Start returns once the images dir is loaded and pinned,
// and its Keeper is the kubelet's image GC filter.
func ExampleStart() {
	ctx := context.Background()
	keeper, _, err := k3spinning.Start(ctx, k3spinning.Config{
		Address:    "/run/k3s/containerd/containerd.sock",
		ImagesDir:  "/var/lib/rancher/k3s/agent/images",
		Kubeconfig: "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
		NodeName:   "node-1",
		Settings:   k3spinning.Settings{},
	})
	if errors.Is(err, errors.ErrUnsupported) {
		return // Windows: k3s imports agent/images itself
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return
	}
	// k3s registers it with the kubelet (patches/kubernetes):
	//   kubeletimages.RegisterGCFilter("k3s-pinning", func(img kubecontainer.Image) bool {
	//       return keeper.Keep(img.ID, img.RepoTags, img.RepoDigests)
	//   })
	_ = keeper.Keep
}
