package fluxvm

import (
	"context"
	"fmt"
)

// ctxErr is the error of a call whose context ended before it changed
// anything: it names the call and wraps the context's error
// (errors.Is(err, context.Canceled) or context.DeadlineExceeded); nil
// while ctx is live.
func ctxErr(ctx context.Context, op string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("fluxvm: %s: %w", op, err)
	}
	return nil
}

// begin is the entry check of a call that does I/O: the dataplane is one
// Open made, and ctx has not ended.
func (d *Dataplane) begin(ctx context.Context, op string) error {
	if err := d.opened(op); err != nil {
		return err
	}
	return ctxErr(ctx, op)
}
