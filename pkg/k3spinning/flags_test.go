package k3spinning_test

import (
	"strings"
	"testing"

	ctrimages "github.com/containerd/containerd/v2/core/images"
	"github.com/distribution/reference"
	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/k3spinning"
)

// ctrImage is an image as containerd lists it, by its full name.
func ctrImage(ref string) ctrimages.Image {
	named, err := reference.ParseNormalizedNamed(ref)
	if err != nil {
		panic(err)
	}
	return ctrimages.Image{Name: named.String()}
}

// k3sApp is a k3s-like app: `server` and `agent` each with the k3s-pinning flags appended, as the
// patch appends them, sharing one options value.
func k3sApp(o *k3spinning.Settings, prefix string) *cli.App {
	action := func(*cli.Context) error { return nil }
	return &cli.App{
		Name: "k3s",
		// As k3s's cmd/server, cmd/agent and cmd/k3s set it: a list flag's K3S_ variable is one value.
		DisableSliceFlagSeparator: true,
		Commands: []*cli.Command{
			{Name: "server", Flags: k3spinning.Flags(o, prefix), Action: action},
			{Name: "agent", Flags: k3spinning.Flags(o, prefix), Action: action},
		},
	}
}

func TestK3sFlags(t *testing.T) {
	for _, c := range []struct {
		name    string
		args    []string
		env     map[string]string
		prefix  string
		wantErr string // "" parses; else the error names this
		check   func(*k3spinning.Settings) bool
	}{
		{name: "defaults: pinning and restore on, no policy", args: []string{"agent"},
			check: func(o *k3spinning.Settings) bool {
				return !o.DisableImagePinning && !o.DisableImageRestore && len(o.PinnedImages) == 0
			}},
		{name: "server has them too", args: []string{"server", "--disable-image-restore", "--pinned-images", "registry.local/*"},
			check: func(o *k3spinning.Settings) bool {
				return !o.DisableImagePinning && o.DisableImageRestore && strings.Join(o.PinnedImages, ",") == "registry.local/*"
			}},
		// What k3s's config file (/etc/rancher/k3s/config.yaml) becomes: `key: value` and lists as
		// repeated --key=value, before the command line.
		{name: "config-file keys", args: []string{"agent", "--disable-image-restore=true", "--pinned-images=a.example/x:1", "--pinned-images=b.example/*", "--pinned-image-labels=team=infra"},
			check: func(o *k3spinning.Settings) bool {
				return o.DisableImageRestore && len(o.PinnedImages) == 2 && o.PinnedImageLabels[0] == "team=infra"
			}},
		// k3s reads the variable as one value (no splitting); the policy splits it on commas.
		{name: "K3S_ environment variables", args: []string{"agent"},
			env: map[string]string{"K3S_DISABLE_IMAGE_RESTORE": "true", "K3S_PINNED_IMAGES": "a.example/x:1,b.example/*"},
			check: func(o *k3spinning.Settings) bool {
				p, err := o.Policy()
				return err == nil && o.DisableImageRestore && p.Wants(ctrImage("a.example/x:1")) && p.Wants(ctrImage("b.example/y:2")) && !p.Wants(ctrImage("a.example/x:2"))
			}},
		{name: "the program's own prefix (rke2)", args: []string{"agent"}, prefix: "RKE2",
			env:   map[string]string{"RKE2_DISABLE_IMAGE_PINNING": "true", "K3S_DISABLE_IMAGE_PINNING": "false"},
			check: func(o *k3spinning.Settings) bool { return !!o.DisableImagePinning }},
		{name: "disabled", args: []string{"agent", "--disable-image-pinning"},
			check: func(o *k3spinning.Settings) bool { return !!o.DisableImagePinning }},
		{name: "bad boolean", args: []string{"agent", "--disable-image-pinning=maybe"}, wantErr: "disable-image-pinning"},
		{name: "bad boolean in the environment", args: []string{"agent"},
			env: map[string]string{"K3S_DISABLE_IMAGE_RESTORE": "perhaps"}, wantErr: "disable-image-restore"},
		{name: "malformed pattern", args: []string{"agent", "--pinned-images", "registry.local/[app"}, wantErr: "--pinned-images"},
		{name: "malformed label selector", args: []string{"server", "--pinned-image-labels", "=x"}, wantErr: "--pinned-image-labels"},
		{name: "policy without pinning", args: []string{"agent", "--disable-image-pinning", "--pinned-images", "a.example/x:1"}, wantErr: "--disable-image-pinning"},
		// No flag given: no action reads them, and 0 is the agent's DefaultFetchMaxDiskUsage.
		{name: "the fleet's flags: off by default", args: []string{"agent"},
			check: func(o *k3spinning.Settings) bool {
				return !o.FetchMissingImages && !o.RetainRemovedArchiveImages && o.FetchMaxDiskUsage == 0
			}},
		{name: "the fleet's flags as config-file keys", args: []string{"server", "--fetch-missing-images=true", "--retain-removed-archive-images=true", "--fetch-max-disk-usage=70"},
			check: func(o *k3spinning.Settings) bool {
				return o.FetchMissingImages && o.RetainRemovedArchiveImages && o.FetchMaxDiskUsage == 70
			}},
		{name: "the fleet's flags as K3S_ variables", args: []string{"agent"},
			env: map[string]string{"K3S_FETCH_MISSING_IMAGES": "true", "K3S_RETAIN_REMOVED_ARCHIVE_IMAGES": "true", "K3S_FETCH_MAX_DISK_USAGE": "60"},
			check: func(o *k3spinning.Settings) bool {
				return o.FetchMissingImages && o.RetainRemovedArchiveImages && o.FetchMaxDiskUsage == 60
			}},
		{name: "disk usage over 100", args: []string{"agent", "--fetch-max-disk-usage", "101"}, wantErr: "--fetch-max-disk-usage 101"},
		{name: "fetch without pinning", args: []string{"agent", "--disable-image-pinning", "--fetch-missing-images"}, wantErr: "--disable-image-pinning"},
	} {
		t.Run(c.name, func(t *testing.T) {
			for k, v := range c.env {
				t.Setenv(k, v)
			}
			prefix := c.prefix
			if prefix == "" {
				prefix = "K3S"
			}
			o := &k3spinning.Settings{}
			err := k3sApp(o, prefix).Run(append([]string{"k3s"}, c.args...))
			switch {
			case c.wantErr == "" && err != nil:
				t.Fatalf("%v: %v", c.args, err)
			case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
				t.Fatalf("%v: error %v, want one naming %s", c.args, err, c.wantErr)
			case c.check != nil && !c.check(o):
				t.Errorf("%v: options %+v", c.args, o)
			}
		})
	}
}

// A bad value stops the command before its action runs (k3s starts nothing), with an error naming
// the flag, also with --disable-image-pinning, and whichever way the value came.
func TestK3sFlagsRefuseBadValuesBeforeTheCommandRuns(t *testing.T) {
	for _, c := range []struct {
		args    []string
		env     map[string]string
		wantErr string
	}{
		{args: []string{"server", "--pinned-images", "registry.local/[app"}, wantErr: "--pinned-images"},
		{args: []string{"server", "--disable-image-pinning", "--pinned-images", "a.example/x:1"}, wantErr: "--disable-image-pinning"},
		{args: []string{"agent", "--disable-image-pinning"}, env: map[string]string{"K3S_PINNED_IMAGE_LABELS": "=x"}, wantErr: "--pinned-image-labels"},
	} {
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		o := &k3spinning.Settings{}
		ran := false
		run := func(*cli.Context) error { ran = true; return nil }
		app := &cli.App{Name: "k3s", Commands: []*cli.Command{
			{Name: "server", Flags: k3spinning.Flags(o, "K3S"), Action: run},
			{Name: "agent", Flags: k3spinning.Flags(o, "K3S"), Action: run},
		}}
		err := app.Run(append([]string{"k3s"}, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.wantErr) {
			t.Errorf("%v %v: error %v, want one naming %s", c.args, c.env, err, c.wantErr)
		}
		if ran {
			t.Errorf("%v %v: the command ran despite the bad value", c.args, c.env)
		}
	}
}
