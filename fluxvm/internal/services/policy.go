package services

import (
	"errors"
	"fmt"

	"github.com/fluxvm/servicefabric/bpf"
	"github.com/fluxvm/servicefabric/fluxvm/internal/errs"
)

// What the identity policy component changes in the frontends of a
// service (through the facade's view, with the lock held).

// SetPolicyFlags rewrites the live entry of frontend sid of s with on as
// its policy flags (SvcFlagPolicy, SvcFlagL7); the rest stays.
func (p *Programmer) SetPolicyFlags(s *Service, sid uint32, on uint32) error {
	for _, fe := range s.Frontends {
		if fe.sid != sid || !fe.live {
			continue
		}
		flags := fe.flags&^(bpf.SvcFlagPolicy|bpf.SvcFlagL7) | on
		if err := p.deps.Maps.Put(fe.key, bpf.SvcValue{ServiceId: fe.sid, Flags: flags, Revision: fe.rev}); err != nil {
			return err
		}
		fe.flags = flags
		return nil
	}
	return fmt.Errorf("service %q: frontend %d: %w", s.Intent.Name, sid, errs.ErrNotFound)
}

// CloseGuards closes the guards of the live frontends of ss whose guards
// are open; reopen opens them again (as open as their guard says then).
// On an error, what it closed is open again.
func (p *Programmer) CloseGuards(ss []*Service) (reopen func() error, err error) {
	var closed []*Frontend
	reopen = func() error {
		var errs []error
		for _, fe := range closed {
			g := bpf.Guard{Revision: fe.rev}
			if fe.guard {
				g.State = bpf.GuardOpen
			}
			if err := p.deps.Maps.PutGuard(fe.sid, g); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	for _, s := range ss {
		for _, fe := range s.Frontends {
			if !fe.live || !fe.guard {
				continue
			}
			if err := p.deps.Maps.PutGuard(fe.sid, bpf.Guard{Revision: fe.rev}); err != nil {
				return nil, errors.Join(err, reopen())
			}
			closed = append(closed, fe)
		}
	}
	return reopen, nil
}
