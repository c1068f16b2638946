// Command l7proxy is a small HTTP proxy configured from the Envoy document
// of one FluxVM service (GET /v1/network/services/{name}/l7/envoy, or
// fluxvm.Dataplane.Envoy): the reference for what an Envoy/xDS adapter
// makes of the document, and the proxy the L7 enforce lab test runs in its
// own namespace. Production nodes run Envoy; this proxy speaks HTTP/1.1
// only (a grpc document's cluster needs HTTP/2).
//
//	l7proxy -doc envoy.json [-upstream vip|cluster]
//
// It serves every listener of the document. The datapath hands it the
// service's flows still addressed to the VIP, so the proxy's namespace
// must deliver the VIP locally to packets that come in from the node
// while the proxy itself still routes to the VIP (docs/operations.md,
// "L7 enforce"); the proxy listens on the listeners' ports on every
// address, transparent (IP_TRANSPARENT, as Envoy's listeners with
// transparent: true): its answers leave from the VIP, no address of its
// namespace. A request whose authority the virtual host's domains do not
// match, or whose path no route's prefix starts, gets 403. The others go
// on, with the header X-Fluxvm-L7-Proxy:
//
//   - upstream vip (the default): to the VIP and port the client
//     addressed. The node load-balances them as any flow (the proxy
//     interface is the bypass: they are not handed back to the proxy).
//   - upstream cluster: to the cluster's endpoints, picked by weight, as
//     Envoy does.
//
// It prints "l7proxy: serving" once every listener is open and stops on
// SIGINT or SIGTERM.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"os"
	"os/signal"
	"path"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fluxvm/servicefabric/fluxvm"
)

func main() {
	docPath := flag.String("doc", "", "the service's Envoy document (JSON)")
	upstream := flag.String("upstream", "vip", "where allowed requests go: vip or cluster")
	flag.Parse()
	if err := run(*docPath, *upstream); err != nil {
		fmt.Fprintln(os.Stderr, "l7proxy:", err)
		os.Exit(1)
	}
}

func run(docPath, upstream string) error {
	if docPath == "" {
		return errors.New("-doc is required")
	}
	raw, err := os.ReadFile(docPath)
	if err != nil {
		return err
	}
	var doc fluxvm.EnvoyDocument
	if err := json.Unmarshal(raw, &doc); err != nil {
		return fmt.Errorf("%s: %w", docPath, err)
	}
	p, err := newProxy(&doc, upstream)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	var ports []uint16
	for _, l := range doc.Listeners {
		if !slices.Contains(ports, l.Port) {
			ports = append(ports, l.Port)
		}
	}
	if len(ports) == 0 {
		return fmt.Errorf("%s: the document has no listener", docPath)
	}
	errc := make(chan error, len(ports))
	for _, port := range ports {
		ln, err := (&net.ListenConfig{Control: transparent}).Listen(ctx, "tcp", net.JoinHostPort("", strconv.Itoa(int(port))))
		if err != nil {
			return err
		}
		go func() { errc <- srv.Serve(ln) }()
	}
	fmt.Printf("l7proxy: serving %s on ports %v (upstream %s, %d virtual hosts)\n", doc.Service, ports, upstream, len(p.hosts))
	select {
	case <-ctx.Done():
	case err := <-errc:
		return err
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

// proxy is one document's routes and upstream.
type proxy struct {
	service string
	hosts   []fluxvm.EnvoyVirtualHost
	cluster []fluxvm.EnvoyEndpoint
	toVIP   bool
	rp      *httputil.ReverseProxy
}

func newProxy(doc *fluxvm.EnvoyDocument, upstream string) (*proxy, error) {
	p := &proxy{service: doc.Service, cluster: doc.Cluster.Endpoints}
	switch upstream {
	case "vip":
		p.toVIP = true
	case "cluster":
		if len(p.cluster) == 0 {
			return nil, errors.New("upstream cluster: the document's cluster has no endpoint")
		}
	default:
		return nil, fmt.Errorf("-upstream %q: want vip or cluster", upstream)
	}
	p.hosts = doc.Routes.VirtualHosts
	// One upstream connection per request: each is a flow of its own
	// through the node, which the lab test counts.
	tr := &http.Transport{DisableKeepAlives: true, DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}
	p.rp = &httputil.ReverseProxy{Transport: tr, Rewrite: p.rewrite}
	return p, nil
}

// allowed: the first virtual host whose domains match the request's
// authority (as Envoy picks one) has a route whose prefix starts its path.
func (p *proxy) allowed(r *http.Request) bool {
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	for _, vh := range p.hosts {
		if slices.ContainsFunc(vh.Domains, func(d string) bool {
			return d == "*" || strings.EqualFold(d, r.Host) || strings.EqualFold(d, host)
		}) {
			return slices.ContainsFunc(vh.Routes, func(rt fluxvm.EnvoyRoute) bool { return strings.HasPrefix(r.URL.Path, rt.Prefix) })
		}
	}
	return false
}

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// A path that is not in its clean form ("/api/../admin", also
	// percent-encoded) could pass a prefix it does not belong under:
	// refused, as Envoy's path normalisation would rewrite it first.
	// ";" and "\" are separators to some backends (path parameters,
	// Windows paths): refused too.
	if r.URL.Path == "" || strings.ContainsAny(r.URL.Path, ";\\") ||
		path.Clean(r.URL.Path) != r.URL.Path && path.Clean(r.URL.Path)+"/" != r.URL.Path {
		http.Error(w, "l7proxy: "+p.service+": the path is not in its clean form", http.StatusBadRequest)
		return
	}
	if !p.allowed(r) {
		http.Error(w, "l7proxy: "+p.service+": denied by its L7 policy", http.StatusForbidden)
		return
	}
	w.Header().Set("X-Fluxvm-L7-Proxy", p.service)
	p.rp.ServeHTTP(w, r)
}

// rewrite addresses the request to its upstream: the VIP and port the
// client connected to, or a cluster endpoint by weight.
func (p *proxy) rewrite(pr *httputil.ProxyRequest) {
	pr.Out.URL.Scheme = "http"
	pr.Out.URL.Host = p.target(pr.In).String()
	pr.Out.Host = pr.In.Host
	pr.SetXForwarded()
}

func (p *proxy) target(r *http.Request) netip.AddrPort {
	if p.toVIP {
		if a, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr); ok {
			if ap, err := netip.ParseAddrPort(a.String()); err == nil {
				return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
			}
		}
	}
	if len(p.cluster) == 0 {
		return netip.AddrPort{} // no upstream: 502
	}
	total := uint32(0)
	for _, e := range p.cluster {
		total += e.Weight
	}
	n := rand.Uint32N(max(total, 1))
	for _, e := range p.cluster {
		if n < e.Weight {
			return netip.AddrPortFrom(e.Address, e.Port)
		}
		n -= e.Weight
	}
	e := p.cluster[0]
	return netip.AddrPortFrom(e.Address, e.Port)
}
