//go:build !linux

package policies

import (
	"fmt"

	"github.com/fluxvm/servicefabric/intent"
)

// ProxyDevice: L7 enforce needs Linux's veth and bpf_redirect_peer.
func ProxyDevice(name string) (uint32, error) {
	return 0, fmt.Errorf("interface %q: %w: L7 enforce needs Linux", name, intent.ErrUnsupported)
}
