package intent

import (
	"errors"
	"fmt"
)

// Error categories, checkable with errors.Is. The REST API maps each to a
// stable error code and HTTP status. Package fluxvm re-exports them under
// the same names (fluxvm.ErrInvalid is ErrInvalid) and adds the categories
// of a running dataplane (fluxvm.ErrNotFound, fluxvm.ErrClosed).
var (
	// ErrInvalid: the request is malformed or out of range.
	ErrInvalid = errors.New("invalid")
	// ErrUnsupported: the request asks for a feature this build or this
	// kernel does not have.
	ErrUnsupported = errors.New("unsupported")
	// ErrConflict: the request clashes with other state (for example a
	// frontend another service already uses).
	ErrConflict = errors.New("conflict")
	// ErrLimit: the request would exceed a documented bound or a map
	// capacity of the loaded tier.
	ErrLimit = errors.New("limit exceeded")
)

// ValidationError says which field of a request is wrong and why. Its
// Kind is one of the categories above (ErrInvalid when unset).
type ValidationError struct {
	Field  string
	Reason string
	Kind   error
}

func (e *ValidationError) Error() string {
	if e.Field == "" {
		return e.Reason
	}
	return fmt.Sprintf("%s: %s", e.Field, e.Reason)
}

// Unwrap makes errors.Is(err, ErrUnsupported) and friends work.
func (e *ValidationError) Unwrap() error {
	if e.Kind == nil {
		return ErrInvalid
	}
	return e.Kind
}
