// Command fluxvmd is the reference FluxVM Service Fabric daemon for
// standalone nodes: it opens the node's dataplane from a TOML configuration
// and serves the REST API.
//
//	fluxvmd [-config /etc/fluxvm/fluxvmd.toml] [run]   serve (default)
//	fluxvmd [-config ...] check-config                 validate the config (and the cgroup of
//	                                                   cgroup_connect on this host) and exit
//	fluxvmd [-config ...] cleanup                      remove everything FluxVM owns
//
// Stopping the daemon leaves the datapath forwarding: pins, attachments,
// the fq qdiscs of edt_manage_fq and the catalog stay, and the next start
// adopts them without disturbing established flows. The VIP advertisement
// snapshot (advertisements_path) stays as last published. `cleanup`
// (fluxvm.Cleanup) detaches the programs, removes the pin root, FluxVM's
// fq qdiscs, the catalog and the HA lease file, and publishes an empty
// advertisement snapshot so that routing adapters withdraw every VIP. It
// reads only pin_root, catalog_path, advertisements_path and node_name
// from the file (a file that no longer validates can be cleaned up), and
// fails, changing nothing, while a fluxvmd runs on the pin root.
//
// Tokens come from the files named in the [sandbox.dataplane.service.api]
// table or from FLUXVM_ADMIN_TOKEN / FLUXVM_READ_TOKEN; an admin token is
// required. A token file whose mode grants any permission to group or
// others is refused (run and check-config fail naming it), as ssh refuses
// such a key.
//
// The REST server bounds what a client can hold: request headers must
// arrive within 10 s (at most 64 KiB), a body within api.body_timeout
// (default 30 s; a request refused before its body is read is answered
// at once and its connection closed), the answer must be written within
// body_timeout + 2 min of the headers, and an idle keep-alive connection
// is closed after 2 min.
//
// With otlp_endpoint set the daemon sends the FluxScope flow records (OTLP
// logs) and spans of its own work (OTLP traces: REST requests, applies,
// the catalog's restore, GC rounds, health reconciles) to the same
// receiver. At stop it runs a final round of the periodic flow export and
// sends what is left within a flush deadline of 5 s; an on-demand export
// still waiting on the receiver then is cancelled (answered 503 "fluxvmd
// is stopping"), so a slow or dead receiver cannot hold the stop
// (docs/operations.md, "Flows export (OTLP)").
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/fluxvm/servicefabric/flows"
	"github.com/fluxvm/servicefabric/fluxvm"
	"github.com/fluxvm/servicefabric/fluxvm/api"
)

func main() {
	if err := run(context.Background(), os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "fluxvmd:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("fluxvmd", flag.ContinueOnError)
	cfgPath := fs.String("config", "/etc/fluxvm/fluxvmd.toml", "configuration file")
	logJSON := fs.Bool("log-json", false, "log as JSON instead of text")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cmd := "run"
	if fs.NArg() > 1 {
		return fmt.Errorf("one command at most, got %q", fs.Args())
	}
	if fs.NArg() == 1 {
		cmd = fs.Arg(0)
	}
	var h slog.Handler = slog.NewTextHandler(os.Stderr, nil)
	if *logJSON {
		h = slog.NewJSONHandler(os.Stderr, nil)
	}
	log := slog.New(h)

	if cmd == "cleanup" {
		return cleanup(*cfgPath, log)
	}
	cfg, err := loadConfig(*cfgPath)
	if err != nil {
		return err
	}
	switch cmd {
	case "check-config":
		if err := checkTokenFiles(cfg.API); err != nil {
			return err
		}
		if cfg.IPCacheFile != "" {
			if _, err := readIPCacheFile(cfg.IPCacheFile); err != nil {
				return err
			}
		}
		// The cgroup of socket load balancing must exist on this host,
		// on cgroup v2, as the start will require.
		cgroup, err := cfg.SocketLBCgroup()
		if err != nil {
			return err
		}
		cfg.CgroupPath = cgroup
		fmt.Print(describeConfig(cfg.Config))
		return nil
	case "run":
		return serve(ctx, cfg, log)
	}
	return fmt.Errorf("unknown command %q (run, check-config, cleanup)", cmd)
}

// describeConfig is what check-config prints about a valid configuration:
// the settings that decide where the datapath attaches, how it SNATs and
// which backend a new flow gets.
func describeConfig(cfg fluxvm.Config) string {
	var b strings.Builder
	b.WriteString("configuration is valid\n")
	fmt.Fprintf(&b, "map_tier %s, pin_root %s\n", strings.ToUpper(cfg.MapTier), cfg.PinRoot)
	fmt.Fprintf(&b, "vm_edge_interfaces: %d\n", len(cfg.VMEdgeInterfaces))
	ns := "none (north-south and both exposure are refused)"
	if len(cfg.NorthSouthInterfaces) > 0 {
		ns = strings.Join(cfg.NorthSouthInterfaces, ", ")
	}
	fmt.Fprintf(&b, "north_south_interfaces: %s\n", ns)
	for _, f := range []struct {
		name string
		v6   bool
	}{{"IPv4", false}, {"IPv6", true}} {
		a := "none (north-south NAT of " + f.name + " VIPs is refused)"
		if addr := cfg.SNATAddressFor(f.v6); addr.IsValid() {
			a = addr.String()
		}
		fmt.Fprintf(&b, "snat %s address: %s\n", f.name, a)
	}
	fmt.Fprintf(&b, "snat ports: %d..%d\n", cfg.SNATPortMin, cfg.SNATPortMax)
	fmt.Fprintf(&b, "seeds: hash_seed %d, maglev_seed %d (nodes that must agree on flows need the same)\n", cfg.HashSeed, cfg.MaglevSeed)
	switch {
	case !cfg.CgroupConnect:
		b.WriteString("socket load balancing: off (cgroup_connect false)\n")
	case cfg.CgroupPath == "":
		b.WriteString("socket load balancing: on, on the root of the cgroup v2 hierarchy (every process of the node)\n")
	default:
		fmt.Fprintf(&b, "socket load balancing: on, on cgroup %s (its processes and those of the cgroups below it)\n", cfg.CgroupPath)
	}
	fmt.Fprintf(&b, "catalog_path: %s\n", cfg.CatalogPath)
	node := ""
	if cfg.NodeName != "" {
		node = fmt.Sprintf(" (node %s)", cfg.NodeName)
	}
	fmt.Fprintf(&b, "advertisements_path: %s%s\n", cfg.AdvertisementsPath, node)
	return b.String()
}

// cleanup is `fluxvmd cleanup`: fluxvm.Cleanup with the pin root, catalog
// and advertisement file (and node name) of the configuration file, read
// without validating the rest of it (fluxvm.ParseCleanupConfig), so that
// a file edited or downgraded into one that no longer validates can still
// be cleaned up. Nothing is loaded or attached first. While a dataplane
// holds the pin root (fluxvmd running) it fails with fluxvm.ErrInUse,
// naming the holder, and changes nothing.
func cleanup(path string, log *slog.Logger) error {
	data, err := fluxvm.ReadConfigFile(path)
	if err != nil {
		return err
	}
	o, err := fluxvm.ParseCleanupConfig(data)
	if err != nil {
		return fmt.Errorf("config %s: %w", path, err)
	}
	o.Logger = log
	if err := fluxvm.Cleanup(context.Background(), o); err != nil {
		return err
	}
	log.Info("fluxvmd: removed the datapath, its pins, the catalog and the HA lease; every VIP is withdrawn",
		"pin_root", o.PinRoot, "catalog_path", o.CatalogPath, "advertisements_path", o.AdvertisementsPath)
	return nil
}

func serve(ctx context.Context, cfg config, log *slog.Logger) error {
	admin, read, err := tokens(cfg.API)
	if err != nil {
		return err
	}
	// The ipcache file is checked before anything is opened: a bad file
	// stops the start, naming it.
	var ipc fluxvm.IPCache
	if cfg.IPCacheFile != "" {
		if ipc, err = readIPCacheFile(cfg.IPCacheFile); err != nil {
			return err
		}
	}
	opts := fluxvm.OptionsFrom(cfg.Config)
	opts.Logger = log
	var tr *tracing
	if cfg.OTLPConfig.Endpoint != "" {
		if tr, err = startTracing(ctx, cfg.OTLPConfig.exporterConfig(cfg.NodeName), log); err != nil {
			return err
		}
		// On the way out before serving (after the dataplane closed);
		// the stop below does it within the flush deadline, and this
		// then does nothing.
		defer func() {
			flush, cancel := context.WithTimeout(context.Background(), otlpFlushTimeout)
			defer cancel()
			tr.stop(flush)
		}()
		opts.TracerProvider = tr.tp
	}
	d, err := fluxvm.Open(ctx, opts)
	if err != nil {
		return err
	}
	defer d.Close()
	if cfg.IPCacheFile != "" {
		st, err := d.SetIPCache(ctx, ipc)
		if err != nil {
			return fmt.Errorf("ipcache_file %s: %w", cfg.IPCacheFile, err)
		}
		log.Info("fluxvmd: ipcache applied", "ipcache_file", cfg.IPCacheFile, "prefixes", st.IPCachePrefixes,
			"policies", len(st.Policies))
	}
	var exporter api.FlowExporter
	var fx *flowExport
	if cfg.OTLPConfig.Endpoint != "" {
		// The export's last round runs after ctx ended (the shutdown
		// flushes what settled): its reads outlive ctx.
		readCtx := context.WithoutCancel(ctx)
		read := func(limit int, f flows.Filter) ([]flows.Record, error) { return d.Flows(readCtx, limit, f) }
		fx, err = startFlowExport(cfg.OTLPConfig.exporterConfig(cfg.NodeName), read, log)
		if err != nil {
			return err
		}
		exporter = fx.api
		// On the way out before serving; the stop below does it within
		// the flush deadline, and this then does nothing.
		defer func() {
			flush, cancel := context.WithTimeout(context.Background(), otlpFlushTimeout)
			defer cancel()
			fx.stop(flush)
		}()
		xc := fx.x.Config()
		log.Info("fluxvmd: exporting flows", "otlp_endpoint", xc.Endpoint, "otlp_encoding", xc.Encoding,
			"otlp_interval", xc.Interval, "flow_sample_rate", cfg.FlowSampleRate)
		if cfg.FlowSampleRate == 0 {
			log.Warn("fluxvmd: otlp_endpoint is set but flow_sample_rate is 0: no flows are recorded, none will be exported")
		}
	}
	var tp trace.TracerProvider
	if tr != nil {
		tp = tr.tp
	}
	srv, err := newAPIServer(api.RolesOf(d), cfg.API, admin, read, log, exporter, tp, ipcacheSource(cfg.IPCacheFile))
	if err != nil {
		return err
	}
	tcp, err := net.Listen("tcp", cfg.API.Listen)
	if err != nil {
		return err
	}
	ln := newLimitListener(tcp, cfg.API.MaxConnections)
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() {
		if cfg.API.TLSCertFile != "" {
			errc <- srv.ServeTLS(ln, cfg.API.TLSCertFile, cfg.API.TLSKeyFile)
		} else {
			errc <- srv.Serve(ln)
		}
	}()
	log.Info("fluxvmd: serving", "listen", ln.Addr().String(), "tls", cfg.API.TLSCertFile != "",
		"advertisements_path", cfg.AdvertisementsPath)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("fluxvmd: stopping; the datapath keeps forwarding and the advertisement snapshot stays as last published")
	// Shutdown waits for the requests in flight; meanwhile the flow
	// export stops within its flush deadline, which also ends an
	// on-demand export still waiting on the receiver, so that Shutdown
	// finishes within its own deadline.
	shut, cancel := context.WithTimeout(context.Background(), apiShutdownTimeout)
	defer cancel()
	shutdown := make(chan error, 1)
	go func() { shutdown <- srv.Shutdown(shut) }()
	flush, cancelFlush := context.WithTimeout(context.Background(), otlpFlushTimeout)
	defer cancelFlush()
	if fx != nil {
		fx.stop(flush)
	}
	err = <-shutdown
	// The spans of the last requests are ended now: what is left of the
	// flush deadline sends them.
	if tr != nil {
		tr.stop(flush)
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("stopping the REST server: %w", err)
	}
	return nil
}

// Limits of the REST server (see the package comment). The body deadline
// is api.body_timeout, enforced by the handler (api.Options.BodyTimeout).
const (
	apiReadHeaderTimeout = 10 * time.Second
	apiMaxHeaderBytes    = 64 << 10
	apiIdleTimeout       = 2 * time.Minute
	// apiHandlerTime is what the longest request (a health round, a
	// conntrack GC of a large table) may take after its body, answer
	// written; WriteTimeout is the body timeout plus this.
	apiHandlerTime = 2 * time.Minute
	// apiShutdownTimeout bounds the wait for the requests in flight at
	// stop.
	apiShutdownTimeout = 10 * time.Second
	// otlpFlushTimeout bounds the stop of the flow export: on-demand
	// exports in flight and the flush of the queue. It is below
	// apiShutdownTimeout, so that an export cancelled at this deadline
	// lets the REST server's shutdown finish within its own.
	otlpFlushTimeout = 5 * time.Second
)

// newAPIServer returns the daemon's REST server for dp, not yet serving.
// The REST requests are traced with tp when it is not nil; ipc is the
// ipcache source of POST …/policies/reconcile (nil without ipcache_file).
func newAPIServer(roles api.Roles, a APIConfig, admin, read []string, log *slog.Logger, x api.FlowExporter, tp trace.TracerProvider,
	ipc api.IPCacheSource) (*http.Server, error) {
	bodyTimeout := a.BodyTimeout.Duration
	if bodyTimeout == 0 {
		bodyTimeout = DefaultAPIBodyTimeout
	}
	handler, err := api.New(roles, api.Options{AdminTokens: admin, ReadTokens: read,
		MaxBodyBytes: a.MaxBodyBytes, MaxSnapshotBytes: a.MaxSnapshotBytes, MaxDeltaBytes: a.MaxDeltaBytes, BodyTimeout: bodyTimeout, Logger: log, Exporter: x, TracerProvider: tp, IPCacheSource: ipc})
	if err != nil {
		return nil, err
	}
	return &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: apiReadHeaderTimeout,
		// A backstop: the handler sets a sooner deadline for the body.
		ReadTimeout:    apiReadHeaderTimeout + bodyTimeout,
		WriteTimeout:   bodyTimeout + apiHandlerTime,
		IdleTimeout:    apiIdleTimeout,
		MaxHeaderBytes: apiMaxHeaderBytes,
		ErrorLog:       slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}, nil
}

// errTokenFileMode is wrapped by the error about a token file that group
// or others may access.
var errTokenFileMode = errors.New("token file is accessible to group or others")

// readTokenFile reads the tokens of a token file: one per line, white
// space trimmed, empty lines and lines starting with '#' skipped. It
// refuses a file whose mode grants any permission to group or others.
func readTokenFile(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("token file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("token file: %w", err)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%w: %s has mode %04o; make it readable by its owner only (chmod 600 %s)",
			errTokenFileMode, path, perm, path)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("token file %s: %w", path, err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if t := strings.TrimSpace(line); t != "" && !strings.HasPrefix(t, "#") {
			out = append(out, t)
		}
	}
	return out, nil
}

// checkTokenFiles reads the configured token files, for check-config.
func checkTokenFiles(a APIConfig) error {
	for _, file := range []string{a.AdminTokenFile, a.ReadTokenFile} {
		if file == "" {
			continue
		}
		if _, err := readTokenFile(file); err != nil {
			return err
		}
	}
	return nil
}

// tokens reads the admin and read tokens from their files or environment.
func tokens(a APIConfig) (admin, read []string, err error) {
	get := func(file, env string) ([]string, error) {
		if file != "" {
			return readTokenFile(file)
		}
		if v := strings.TrimSpace(os.Getenv(env)); v != "" {
			return []string{v}, nil
		}
		return nil, nil
	}
	if admin, err = get(a.AdminTokenFile, EnvAdminToken); err != nil {
		return nil, nil, err
	}
	if read, err = get(a.ReadTokenFile, EnvReadToken); err != nil {
		return nil, nil, err
	}
	if len(admin) == 0 {
		return nil, nil, errors.New("no admin token: set admin_token_file or FLUXVM_ADMIN_TOKEN")
	}
	return admin, read, nil
}
