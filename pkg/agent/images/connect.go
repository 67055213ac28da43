package images

import (
	"context"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"google.golang.org/grpc"
)

// DefaultCallTimeout bounds each call to containerd and its CRI, whatever the caller's context
// allows: a containerd that accepts and never answers must not stop the agent for ever. A pull
// takes longer and carries its own deadline (fetchTimeout, listPullTimeout). Streams (a blob's
// write, the event subscription) are not bounded here.
const DefaultCallTimeout = 2 * time.Minute

// pullMethod is the CRI's PullImage, the one call the call timeout leaves to its caller.
const pullMethod = "/runtime.v1.ImageService/PullImage"

// ConnectOpt configures Connect.
type ConnectOpt func(*connectOpts)

type connectOpts struct{ callTimeout time.Duration }

// WithCallTimeout sets the bound of a call without a deadline (DefaultCallTimeout).
func WithCallTimeout(d time.Duration) ConnectOpt {
	return func(o *connectOpts) { o.callTimeout = d }
}

// Connect is a client of the containerd at address for the agent (Services): every unary call
// but a pull ends within the call timeout.
func Connect(address string, opts ...ConnectOpt) (*containerd.Client, error) {
	o := connectOpts{callTimeout: DefaultCallTimeout}
	for _, opt := range opts {
		opt(&o)
	}
	bound := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if method != pullMethod {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, o.callTimeout)
			defer cancel()
		}
		return invoker(ctx, method, req, reply, cc, callOpts...)
	}
	return containerd.New(address, containerd.WithTimeout(10*time.Second),
		containerd.WithExtraDialOpts([]grpc.DialOption{grpc.WithChainUnaryInterceptor(bound)}))
}
