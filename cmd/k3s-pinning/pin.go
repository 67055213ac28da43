package main

import (
	"context"
	"fmt"
	"io"

	"github.com/urfave/cli/v2"

	"github.com/k3s-pinning/k3s-pinning/pkg/agent/images"
)

// pinCommand is `k3s-pinning pin`: pins set by hand, recorded as source "manual".
func pinCommand(o *options, stdout io.Writer) *cli.Command {
	return &cli.Command{
		Name:      "pin",
		Usage:     "pin references by hand (recorded as source \"manual\")",
		ArgsUsage: "REF...",
		Flags:     commonFlags(o),
		Action: func(c *cli.Context) error {
			return eachRef(c, o, func(ctx context.Context, a *images.Agent, ref string) error {
				res, err := a.PinManual(ctx, ref)
				if err == nil {
					fmt.Fprintf(stdout, "%s: %s\n", ref, res)
				}
				return err
			})
		},
	}
}

// unpinCommand is `k3s-pinning unpin`: pins of ours removed; anyone else's never are.
func unpinCommand(o *options, stdout io.Writer) *cli.Command {
	return &cli.Command{
		Name:      "unpin",
		Usage:     "remove pins k3s-pinning set; a pin set by anyone else is never removed",
		ArgsUsage: "REF...",
		Flags:     commonFlags(o),
		Action: func(c *cli.Context) error {
			return eachRef(c, o, func(ctx context.Context, a *images.Agent, ref string) error {
				wantedBy, err := a.UnpinManual(ctx, ref)
				if err != nil {
					return err
				}
				fmt.Fprintf(stdout, "%s: unpinned\n", ref)
				if wantedBy != "" {
					fmt.Fprintf(stdout, "%s: note: %s still wants it; the next sync pins it again\n", ref, wantedBy)
				}
				return nil
			})
		},
	}
}
