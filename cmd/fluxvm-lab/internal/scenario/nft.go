//go:build linux

package scenario

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"

	"github.com/fluxvm/servicefabric/internal/testutils/nsutil"
)

// The nftables load balancer of `fluxvm-lab perf` is built the way
// kube-proxy's nftables mode builds one (pkg/proxy/nftables in Kubernetes):
//
//   - a nat chain on prerouting (priority dstnat) jumps to "services",
//     whose one rule looks daddr . l4proto . dport up in the verdict map
//     "service-ips" and jumps to the service's chain;
//   - the service chain marks traffic from outside the cluster CIDR for
//     masquerade and picks an endpoint with "numgen random mod N vmap";
//   - each endpoint chain marks hairpin traffic and does "dnat to";
//   - conntrack undoes the translation on the replies;
//   - filter chains on prerouting (-110) and forward check new connections
//     against the firewall, no-endpoint and cluster-IP sets, and a nat
//     chain on postrouting masquerades what was marked.
//
// The only additions are named counters in the service chains, so that a
// run can prove which connections nftables translated. They count new
// connections only: nat chains see the first packet of a connection.

// nftService is one service port of the nftables load balancer.
type nftService struct {
	Name      string // namespace/name/protocol/port, as kube-proxy names chains
	Counter   string // named counter of the service chain
	VIP       netip.Addr
	Port      uint16
	Endpoints []netip.AddrPort
}

// kubeProxyRuleset returns an `nft -f` script that (re)creates table
// (family ip) with the services. serviceCIDR plays kube-proxy's service
// CIDR, clusterCIDR its pod CIDR (traffic from outside it is masqueraded).
func kubeProxyRuleset(table string, serviceCIDR, clusterCIDR netip.Prefix, svcs []nftService) string {
	var b strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&b, format+"\n", a...) }
	// "add" then "delete" makes the delete succeed whether or not the
	// table exists; the rest then builds it from scratch in the same
	// transaction.
	p("add table ip %s", table)
	p("delete table ip %s", table)
	p(`add table ip %s { comment "kube-proxy nftables mode, reduced to the services of fluxvm-lab perf" ; }`, table)
	p(`add set ip %s cluster-ips { type ipv4_addr ; comment "Active ClusterIPs" ; }`, table)
	p(`add set ip %s nodeport-ips { type ipv4_addr ; comment "IPs that accept NodePort traffic" ; }`, table)
	for _, m := range []struct{ name, typ, comment string }{
		{"firewall-ips", "ipv4_addr . inet_proto . inet_service : verdict", "destinations that are subject to LoadBalancerSourceRanges"},
		{"no-endpoint-nodeports", "inet_proto . inet_service : verdict", "vmap to drop or reject packets to service nodeports with no endpoints"},
		{"no-endpoint-services", "ipv4_addr . inet_proto . inet_service : verdict", "vmap to drop or reject packets to services with no endpoints"},
		{"service-ips", "ipv4_addr . inet_proto . inet_service : verdict", "ClusterIP, ExternalIP and LoadBalancer IP traffic"},
		{"service-nodeports", "inet_proto . inet_service : verdict", "NodePort traffic"},
	} {
		p(`add map ip %s %s { type %s ; comment "%s" ; }`, table, m.name, m.typ, m.comment)
	}
	for _, c := range []string{
		"cluster-ips-check",
		"filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }",
		"filter-output-pre-dnat { type filter hook output priority -110 ; }",
		"filter-forward { type filter hook forward priority 0 ; }",
		"filter-input { type filter hook input priority 0 ; }",
		"filter-output { type filter hook output priority 0 ; }",
		"firewall-check",
		"mark-for-masquerade",
		"masquerading",
		"nat-output { type nat hook output priority -100 ; }",
		"nat-postrouting { type nat hook postrouting priority 100 ; }",
		"nat-prerouting { type nat hook prerouting priority -100 ; }",
		"nodeport-endpoints-check",
		`reject-chain { comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }`,
		"services",
		"service-endpoints-check",
	} {
		p("add chain ip %s %s", table, c)
	}
	for _, r := range []string{
		`cluster-ips-check ip daddr @cluster-ips reject comment "Reject traffic to invalid ports of ClusterIPs"`,
		fmt.Sprintf(`cluster-ips-check ip daddr { %s } drop comment "Drop traffic to unallocated ClusterIPs"`, serviceCIDR),
		"filter-prerouting-pre-dnat ct state new jump firewall-check",
		"filter-forward ct state new jump service-endpoints-check",
		"filter-forward ct state new jump cluster-ips-check",
		"filter-input ct state new jump nodeport-endpoints-check",
		"filter-input ct state new jump service-endpoints-check",
		"filter-output ct state new jump service-endpoints-check",
		"filter-output-pre-dnat ct state new jump firewall-check",
		"filter-output ct state new jump cluster-ips-check",
		"firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips",
		"mark-for-masquerade mark set mark or 0x4000",
		"masquerading mark and 0x4000 == 0 return",
		"masquerading mark set mark xor 0x4000",
		"masquerading masquerade fully-random",
		"nat-output jump services",
		"nat-postrouting jump masquerading",
		"nat-prerouting jump services",
		"nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports",
		"reject-chain reject",
		"services ip daddr . meta l4proto . th dport vmap @service-ips",
		"services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
		"service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services",
	} {
		p("add rule ip %s %s", table, r)
	}
	for _, s := range svcs {
		svcChain := "service-" + s.Name
		p("add counter ip %s %s", table, s.Counter)
		p("add chain ip %s %s", table, svcChain)
		p("add rule ip %s %s ip daddr %s ip saddr != %s jump mark-for-masquerade", table, svcChain, s.VIP, clusterCIDR)
		var arms []string
		for i, ep := range s.Endpoints {
			epChain := fmt.Sprintf("endpoint-%s__%s/%d", s.Name, ep.Addr(), ep.Port())
			arms = append(arms, fmt.Sprintf("%d : goto %s", i, epChain))
			p("add chain ip %s %s", table, epChain)
			p("add rule ip %s %s ip saddr %s jump mark-for-masquerade", table, epChain, ep.Addr())
			p("add rule ip %s %s meta l4proto tcp dnat to %s", table, epChain, ep)
		}
		p(`add rule ip %s %s counter name "%s" numgen random mod %d vmap { %s }`,
			table, svcChain, s.Counter, len(s.Endpoints), strings.Join(arms, ", "))
		p("add element ip %s cluster-ips { %s }", table, s.VIP)
		p("add element ip %s service-ips { %s . tcp . %d : goto %s }", table, s.VIP, s.Port, svcChain)
	}
	return b.String()
}

// probeRuleset returns an `nft -f` script that (re)creates table with a
// filter chain at the very start of prerouting (priority raw, before any
// conntrack or nat) counting packets addressed to each VIP: counter name
// -> VIP. A filter chain does not enable conntrack.
func probeRuleset(table string, counters map[string]netip.Addr) string {
	var b strings.Builder
	fmt.Fprintf(&b, "add table ip %s\ndelete table ip %s\nadd table ip %s\n", table, table, table)
	fmt.Fprintf(&b, "add chain ip %s prerouting { type filter hook prerouting priority raw ; policy accept ; }\n", table)
	for name, vip := range counters {
		fmt.Fprintf(&b, "add counter ip %s %s\n", table, name)
		fmt.Fprintf(&b, "add rule ip %s prerouting ip daddr %s counter name \"%s\"\n", table, vip, name)
	}
	return b.String()
}

// nftRunner runs the nft binary as a child of a thread inside ns, so that it
// sees and changes that namespace's ruleset only, with script on its
// standard input when script is not empty.
type nftRunner struct {
	path string
	ns   *nsutil.NS
}

// NFTPath finds the nft binary, or says how to install it.
func NFTPath() (string, error) {
	p, err := exec.LookPath("nft")
	if err != nil {
		return "", fmt.Errorf("scenario: the nftables comparison needs the nft binary (apt-get install nftables): %w", err)
	}
	return p, nil
}

func (n *nftRunner) run(ctx context.Context, script string, args ...string) ([]byte, error) {
	var out, stderr bytes.Buffer
	err := n.ns.Do(func() error {
		// A forked child inherits the network namespace of the thread
		// that forks it: this one, locked inside ns.
		cmd := exec.CommandContext(ctx, n.path, args...)
		if script != "" {
			cmd.Stdin = strings.NewReader(script)
		}
		cmd.Stdout, cmd.Stderr = &out, &stderr
		return cmd.Run()
	})
	if err != nil {
		return nil, fmt.Errorf("scenario: nft %s in %s: %w: %s", strings.Join(args, " "), n.ns.Name, err, strings.TrimSpace(stderr.String()))
	}
	return out.Bytes(), nil
}

// apply loads an `nft -f` script.
func (n *nftRunner) apply(ctx context.Context, script string) error {
	_, err := n.run(ctx, script, "-f", "-")
	return err
}

// deleteTable removes a table of family ip if it exists.
func (n *nftRunner) deleteTable(ctx context.Context, table string) error {
	return n.apply(ctx, fmt.Sprintf("add table ip %s\ndelete table ip %s\n", table, table))
}

// counters returns the packet count of every named counter in the
// namespace, keyed "table/name".
func (n *nftRunner) counters(ctx context.Context) (map[string]uint64, error) {
	out, err := n.run(ctx, "", "-j", "list", "counters")
	if err != nil {
		return nil, err
	}
	var doc struct {
		Nftables []struct {
			Counter *struct {
				Table   string `json:"table"`
				Name    string `json:"name"`
				Packets uint64 `json:"packets"`
			} `json:"counter"`
		} `json:"nftables"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return nil, fmt.Errorf("scenario: nft -j list counters: %w", err)
	}
	m := map[string]uint64{}
	for _, o := range doc.Nftables {
		if o.Counter != nil {
			m[o.Counter.Table+"/"+o.Counter.Name] = o.Counter.Packets
		}
	}
	return m, nil
}

// errNFTCounter is returned when a counter the run relies on is missing.
var errNFTCounter = errors.New("nft counter missing")

func nftCounter(m map[string]uint64, table, name string) (uint64, error) {
	v, ok := m[table+"/"+name]
	if !ok {
		return 0, fmt.Errorf("scenario: %s/%s: %w", table, name, errNFTCounter)
	}
	return v, nil
}
