package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"

	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
	"github.com/fluxvm/servicefabric/ha"
)

// The commands of flow-state transfer (HA): snapshots, which stream
// through the CLI without being held in memory, and journal deltas.

const octetStream = "application/octet-stream"

// isTerminal reports whether w is a terminal (a character device).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// exportTrailers reads the counts the node sends after a complete
// snapshot; ok is false when it sent none.
func exportTrailers(t http.Header) (res ha.ExportResult, ok bool) {
	for _, f := range []struct {
		name string
		dst  *uint64
	}{
		{api.TrailerExportFlows, &res.Flows},
		{api.TrailerExportExpired, &res.Expired},
		{api.TrailerExportNotCarried, &res.NotCarried},
		{api.TrailerExportNoBackend, &res.NoBackend},
	} {
		v := t.Get(f.name)
		if v == "" {
			continue
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			continue
		}
		*f.dst, ok = n, true
	}
	return res, ok
}

// cmdConntrackExport streams GET …/{name}/conntrack/export into a file
// (written beside it and renamed once complete, so that a broken-off
// stream never takes the file's name) or stdout. The counts of the
// export go to stdout with -out, else to stderr.
func cmdConntrackExport(inv *invocation) error {
	fs := inv.flags()
	out := fs.String("out", "-", "write the snapshot to this file (\"-\": stdout)")
	pos, err := inv.parse(fs, "NAME")
	if err != nil {
		return err
	}
	name := pos[0]
	if err := serviceArg(name); err != nil {
		return err
	}
	if *out == "" {
		return usagef("-out is empty: give a file, or - for stdout")
	}
	dst, report := inv.stdout, inv.stderr
	var tmp *os.File
	if *out == "-" {
		if isTerminal(inv.stdout) {
			return usagef("refusing to write a binary snapshot to a terminal: give -out FILE or redirect stdout")
		}
	} else {
		tmp, err = os.CreateTemp(filepath.Dir(*out), "."+filepath.Base(*out)+".*.partial")
		if err != nil {
			return fmt.Errorf("create the snapshot file: %w", err)
		}
		defer func() {
			if tmp != nil {
				_ = tmp.Close()
				_ = os.Remove(tmp.Name())
			}
		}()
		dst, report = tmp, inv.stdout
	}
	c, err := newClient(inv.globals, inv.env)
	if err != nil {
		return err
	}
	r := request{method: http.MethodGet, path: servicePath(name, "/conntrack/export"), accept: octetStream}
	resp, err := c.send(context.Background(), r)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	n, err := io.Copy(dst, resp.Body)
	if err != nil {
		return fmt.Errorf("%s %s: the stream broke off after %d bytes: %w (an incomplete snapshot: no importer takes it)",
			r.method, r.path, n, unwrapURLError(err))
	}
	res, counted := exportTrailers(resp.Trailer)
	if tmp != nil {
		if err := tmp.Sync(); err != nil {
			return fmt.Errorf("write the snapshot file: %w", err)
		}
		if err := tmp.Close(); err != nil {
			return fmt.Errorf("write the snapshot file: %w", err)
		}
		if err := os.Rename(tmp.Name(), *out); err != nil {
			return fmt.Errorf("write the snapshot file: %w", err)
		}
		tmp = nil
	}
	if !counted {
		fmt.Fprintf(inv.stderr, "fluxvmctl: warning: the node sent no export counts (a proxy dropping trailers?); %d bytes written\n", n)
		return nil
	}
	if inv.output == "json" {
		b, err := json.MarshalIndent(res, "", "  ")
		if err != nil {
			return err
		}
		_, err = report.Write(append(b, '\n'))
		return err
	}
	where := *out
	if where == "-" {
		where = "stdout"
	}
	_, err = fmt.Fprintf(report, "exported %d flows of %s (%d bytes) to %s; left out: %d expired, %d not carried, %d without their backend\n",
		res.Flows, name, n, where, res.Expired, res.NotCarried, res.NoBackend)
	return err
}

// cmdConntrackImport streams a snapshot from a file or stdin into POST
// …/{name}/conntrack/import.
func cmdConntrackImport(inv *invocation) error {
	fs := inv.flags()
	prune := fs.Bool("prune", false, "also delete the service's flows the snapshot lacks")
	pos, err := inv.parse(fs, "NAME", "FILE|-")
	if err != nil {
		return err
	}
	if err := serviceArg(pos[0]); err != nil {
		return err
	}
	in, n, done, err := inv.input(pos[1], "the snapshot")
	if err != nil {
		return err
	}
	defer done()
	var q url.Values
	if *prune {
		q = url.Values{"prune": {"true"}}
	}
	var res ha.ImportResult
	r := request{method: http.MethodPost, path: servicePath(pos[0], "/conntrack/import"), query: q, body: in, ctype: octetStream, length: n}
	return inv.call(r, &res, func(w io.Writer) { importTable(w, res) })
}

func cmdDelta(inv *invocation) error {
	fs := inv.flags()
	journal := fs.String("journal", "", "the journal incarnation of the cursor (empty: ask for a reset)")
	seq := fs.Uint64("seq", 0, "the last batch applied")
	maxOps := fs.Int("max-ops", 0, "at most this many ops, 1.."+strconv.Itoa(api.MaxDeltaOps)+" (default: the node's, "+strconv.Itoa(api.DefaultDeltaOps)+")")
	pos, err := inv.parse(fs, "NAME")
	if err != nil {
		return err
	}
	if err := serviceArg(pos[0]); err != nil {
		return err
	}
	q := url.Values{}
	if *journal != "" {
		q.Set("journal", *journal)
	}
	if isSet(fs, "seq") {
		q.Set("seq", strconv.FormatUint(*seq, 10))
	}
	if isSet(fs, "max-ops") {
		if *maxOps < 1 || *maxOps > api.MaxDeltaOps {
			return usagef("-max-ops %d: want 1..%d", *maxOps, api.MaxDeltaOps)
		}
		q.Set("max_ops", strconv.Itoa(*maxOps))
	}
	var d ha.Delta
	return inv.call(request{method: http.MethodGet, path: servicePath(pos[0], "/conntrack/delta"), query: q}, &d, func(w io.Writer) { deltaTable(w, d) })
}

func cmdDeltaImport(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "NAME", "FILE|-")
	if err != nil {
		return err
	}
	if err := serviceArg(pos[0]); err != nil {
		return err
	}
	in, n, done, err := inv.input(pos[1], "the delta")
	if err != nil {
		return err
	}
	defer done()
	var res fluxvm.HADeltaResult
	r := request{method: http.MethodPost, path: servicePath(pos[0], "/conntrack/delta/import"), body: in, length: n}
	return inv.call(r, &res, func(w io.Writer) {
		row(w, "Cursor:", cursorString(res.Cursor))
		importCounts(w, res.Applied)
	})
}

func cmdDeltaAck(inv *invocation) error {
	pos, err := inv.parse(inv.flags(), "NAME", "SEQ")
	if err != nil {
		return err
	}
	if err := serviceArg(pos[0]); err != nil {
		return err
	}
	seq, err := strconv.ParseUint(pos[1], 10, 64)
	if err != nil {
		return usagef("SEQ %q: want an unsigned integer (the newest batch every standby applied)", pos[1])
	}
	body, err := json.Marshal(api.DeltaAckRequest{Seq: &seq})
	if err != nil {
		return err
	}
	var st ha.JournalStats
	r := request{method: http.MethodPost, path: servicePath(pos[0], "/conntrack/delta/ack"), body: bytes.NewReader(body)}
	return inv.call(r, &st, func(w io.Writer) { journalTable(w, pos[0], st) })
}
