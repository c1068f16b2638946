//go:build linux

package main

import (
	"errors"
	"flag"
	"fmt"
)

// parseArgs parses a subcommand's flags: help reports -h (printed, nothing
// to run), and arguments that are not flags are an error.
func parseArgs(fs *flag.FlagSet, args []string) (help bool, err error) {
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	if fs.NArg() > 0 {
		return false, fmt.Errorf("%s: unexpected arguments %q", fs.Name(), fs.Args())
	}
	return false, nil
}
