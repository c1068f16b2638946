// Command fluxvmctl is the operator CLI of a FluxVM node: it calls the
// node's REST API (package fluxvm/api) so that nobody has to hand-write
// curl. It prints tables for people and, with -o json, the server's JSON
// as is (indented) for scripts.
//
//	fluxvmctl [flags] services
//	fluxvmctl [flags] service NAME
//	fluxvmctl [flags] status | stats [-all] [-vm ID] | health | ha | pressure
//	fluxvmctl [flags] flows [-service S] [-backend IP] [-verdict V] [-since T] [-limit N]
//	fluxvmctl [flags] advertisements | policies | policy NAME | envoy NAME
//	fluxvmctl [flags] delta NAME [-journal J] [-seq N] [-max-ops N]
//	fluxvmctl [flags] conntrack export NAME [-out FILE]
//	fluxvmctl [flags] apply FILE|- | delete NAME | gc | health-reconcile
//	fluxvmctl [flags] policies apply FILE|- | policies reconcile | policy delete NAME
//	fluxvmctl [flags] pressure reconcile | ha lease [-epoch N] [-superseded-by N]
//	fluxvmctl [flags] conntrack import NAME FILE|- [-prune]
//	fluxvmctl [flags] delta import NAME FILE|- | delta ack NAME SEQ
//	fluxvmctl [flags] telemetry export [-limit N]
//
// Flags (before or after the command): -addr (default
// http://127.0.0.1:7788, or $FLUXVM_ADDR), -token-file, -o table|json,
// -timeout, -ca-file. The bearer token comes from -token-file, else
// $FLUXVM_TOKEN, else $FLUXVM_ADMIN_TOKEN, else $FLUXVM_READ_TOKEN (the
// variables the daemon reads its own tokens from). The mutations (apply,
// delete, gc, health-reconcile and the commands of the last five lines)
// need an admin token. Snapshots stream through (conntrack export and
// import hold no whole snapshot in memory); -timeout bounds the whole
// transfer.
//
// Exit status: 0 success, 1 an error of the API or of the network, 2 a
// usage error (unknown command or flag, missing argument, no token).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"
)

// Exit statuses.
const (
	exitOK    = 0
	exitError = 1 // the API answered an error, or the node was unreachable
	exitUsage = 2 // bad command line or configuration
)

// Defaults and environment variables of the global flags.
const (
	defaultAddr    = "http://127.0.0.1:7788"
	defaultTimeout = 30 * time.Second

	envAddr       = "FLUXVM_ADDR"
	envToken      = "FLUXVM_TOKEN"
	envAdminToken = "FLUXVM_ADMIN_TOKEN" // cmd/fluxvmd's EnvAdminToken
	envReadToken  = "FLUXVM_READ_TOKEN"  // cmd/fluxvmd's EnvReadToken
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr, os.Getenv))
}

// usageError is a mistake of the command line: it exits 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// globals are the flags every command takes.
type globals struct {
	addr      string
	tokenFile string
	output    string
	timeout   time.Duration
	caFile    string
}

// register adds the global flags to fs, with the current values as
// defaults, so that they may be given before or after the command.
func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.addr, "addr", g.addr, "base URL of the node's REST API (env "+envAddr+")")
	fs.StringVar(&g.tokenFile, "token-file", g.tokenFile, "file holding the bearer token (default: $"+envToken+", $"+envAdminToken+", $"+envReadToken+")")
	fs.StringVar(&g.output, "o", g.output, "output format: table or json")
	fs.DurationVar(&g.timeout, "timeout", g.timeout, "bound of the request")
	fs.StringVar(&g.caFile, "ca-file", g.caFile, "PEM file of CA certificates trusted for HTTPS, besides the system roots")
}

// run is the whole command: args without the program name; env reads
// the environment. It returns the exit status.
func run(args []string, stdout, stderr io.Writer, env func(string) string) int {
	g := &globals{addr: defaultAddr, output: "table", timeout: defaultTimeout}
	if v := env(envAddr); v != "" {
		g.addr = v
	}
	fs := flag.NewFlagSet("fluxvmctl", flag.ContinueOnError)
	fs.SetOutput(stderr)
	g.register(fs)
	fs.Usage = func() { usage(stderr, fs) }
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	if fs.NArg() == 0 {
		usage(stderr, fs)
		return exitUsage
	}
	cmd, rest, err := commandByName(fs.Arg(0), fs.Args()[1:])
	if err != nil {
		return report(stderr, err)
	}
	err = cmd.run(&invocation{globals: g, name: cmd.name, args: rest, stdout: stdout, stderr: stderr, env: env})
	return report(stderr, err)
}

// report prints err and returns the exit status it means.
func report(stderr io.Writer, err error) int {
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.Is(err, errFlagParse):
		return exitUsage // the flag package printed why
	case errors.As(err, &ue):
		fmt.Fprintln(stderr, "fluxvmctl:", ue.msg)
		return exitUsage
	}
	fmt.Fprintln(stderr, "fluxvmctl:", err)
	return exitError
}

// usage prints the commands and the global flags.
func usage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprintln(w, "usage: fluxvmctl [flags] COMMAND [command flags] [args]")
	fmt.Fprintln(w, "\ncommands:")
	width := 0
	for _, c := range commands {
		width = max(width, len(c.usage))
	}
	for _, c := range commands {
		fmt.Fprintf(w, "  %-*s  %s\n", width, c.usage, c.help)
	}
	fmt.Fprintln(w, "\nA service named like a second word (delete, import, ack) follows \"--\": policy -- delete.")
	fmt.Fprintln(w, "\nflags (before or after the command):")
	fs.PrintDefaults()
}
