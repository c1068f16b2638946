//go:build !linux

package fluxvm

import (
	"fmt"

	"github.com/fluxvm/servicefabric/intent"
)

// proxyIfindex: L7 enforce needs Linux's veth and bpf_redirect_peer.
func proxyIfindex(name string) (uint32, error) {
	return 0, fmt.Errorf("interface %q: %w: L7 enforce needs Linux", name, intent.ErrUnsupported)
}
