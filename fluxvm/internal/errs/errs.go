// Package errs holds the error categories of a running dataplane that
// its components return and package fluxvm exports (fluxvm.ErrNotFound,
// fluxvm.ErrClosed): one value each, so that errors.Is holds whichever
// name a caller uses. The validation categories (ErrInvalid,
// ErrConflict, ...) are package intent's.
package errs

import "errors"

var (
	// ErrNotFound: no such service or VM, or no such network interface.
	ErrNotFound = errors.New("not found")
	// ErrClosed: the dataplane was closed; it reads and changes no map
	// any more.
	ErrClosed = errors.New("dataplane closed")
)
