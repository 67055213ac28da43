package images

import (
	"context"
	"fmt"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"google.golang.org/grpc"
)

// DefaultCallTimeout bounds each call to containerd and its CRI, whatever the caller's context
// allows: a containerd that accepts and never answers must not stop the agent for ever. A pull
// takes longer and carries its own deadline (fetchTimeout, listPullTimeout). A stream (a blob's
// write or read) may last as long as it moves: it ends once no message went either way for
// the call timeout. The event subscription, quiet while nothing happens, is not bounded.
const DefaultCallTimeout = 2 * time.Minute

const (
	// pullMethod is the CRI's PullImage, the one call the call timeout leaves to its caller.
	pullMethod = "/runtime.v1.ImageService/PullImage"
	// subscribeMethod is containerd's event subscription: Run follows it, and checks that
	// containerd answers by other calls.
	subscribeMethod = "/containerd.services.events.v1.Events/Subscribe"
)

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
	idle := func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, callOpts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method == subscribeMethod {
			return streamer(ctx, desc, cc, method, callOpts...)
		}
		ctx, cancel := context.WithCancelCause(ctx)
		timer := time.AfterFunc(o.callTimeout, func() {
			cancel(fmt.Errorf("%s: no message either way for %s", method, o.callTimeout))
		})
		s, err := streamer(ctx, desc, cc, method, callOpts...)
		if err != nil {
			timer.Stop()
			cancel(nil)
			return nil, err
		}
		return &idleBoundStream{ClientStream: s, timer: timer, idle: o.callTimeout, cancel: cancel}, nil
	}
	return containerd.New(address, containerd.WithTimeout(10*time.Second),
		containerd.WithExtraDialOpts([]grpc.DialOption{grpc.WithChainUnaryInterceptor(bound), grpc.WithChainStreamInterceptor(idle)}))
}

// idleBoundStream is a stream cancelled once idle for its bound: each message sent or received
// starts the wait again; the stream's end (an error from RecvMsg, io.EOF included) stops it.
type idleBoundStream struct {
	grpc.ClientStream
	timer  *time.Timer
	idle   time.Duration
	cancel context.CancelCauseFunc
}

func (s *idleBoundStream) SendMsg(m any) error {
	err := s.ClientStream.SendMsg(m)
	s.timer.Reset(s.idle)
	return err
}

func (s *idleBoundStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err != nil {
		s.timer.Stop()
		s.cancel(nil)
		return err
	}
	s.timer.Reset(s.idle)
	return nil
}
