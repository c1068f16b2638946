package fluxvm

import (
	"errors"
	"fmt"
	"path/filepath"
	"sync"

	"github.com/fluxvm/servicefabric/bpf"
)

// undoStack is the rollback of a failed Open: each step that made
// something pushes what undoes it, and run undoes them all, the last made
// first. Open hands ownership to the Dataplane by not running it.
type undoStack []func() error

func (u *undoStack) push(f func() error) { *u = append(*u, f) }

// run undoes every step, in reverse order, and joins their errors: a
// step that cannot be undone does not stop the others.
func (u undoStack) run() error {
	var errs []error
	for i := len(u) - 1; i >= 0; i-- {
		errs = append(errs, u[i]())
	}
	return errors.Join(errs...)
}

// pinRootOf is the pin root bpf.Open uses for o.
func pinRootOf(o bpf.Options) string {
	if o.PinRoot == "" {
		return bpf.DefaultPinRoot
	}
	return filepath.Clean(o.PinRoot)
}

// detachMade removes what attach and attachXDP put on ifc themselves
// (ifc.made, ifc.madeXDP), leaving alone what was attached before them
// (an earlier start's, adopted): the undo of a failed attach, and of the
// interfaces of a failed Open. An interface none of whose hooks was
// attached before gives its statistics slot back too. d.mu held, or d
// not yet shared.
func (d *Dataplane) detachMade(ifc *iface) error {
	err := d.opts.InNamespace(func() error {
		var errs []error
		for _, h := range ifc.made {
			if err := d.dp.Detach(bpf.Interface{Index: ifc.index}, h); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				errs = append(errs, fmt.Errorf("undo %s: %w", h, err))
			}
		}
		if ifc.madeXDP {
			if err := d.dp.DetachXDP(bpf.Interface{Index: ifc.index}); err != nil && !errors.Is(err, bpf.ErrNotAttached) {
				errs = append(errs, fmt.Errorf("undo xdp: %w", err))
			}
		}
		return errors.Join(errs...)
	})
	if err == nil && len(ifc.made) > 0 && len(ifc.made) == len(ifc.hooks) && ifc.slot != 0 {
		err = d.unregisterEdge(ifc)
	}
	ifc.made, ifc.madeXDP = nil, false
	return err
}

// unlockOnce returns a func that unlocks l the first time it is called
// and does nothing after: for a lock a function lets go early on some
// paths and by a defer on the others.
func unlockOnce(l sync.Locker) func() {
	var once sync.Once
	return func() { once.Do(l.Unlock) }
}
