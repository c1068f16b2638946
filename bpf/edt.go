package bpf

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"time"
)

// EDT pacing (lib/edt.h): fluxvm_edt holds, per service id, the rate its
// egress toward clients may not exceed, the horizon beyond which a
// packet's departure is dropped, and the departure of the last packet
// admitted (the datapath's). Entry EDTNodeKey is the node's: its Rate
// counts the paced north-south services, and fluxvm_ns_out looks for
// their replies only while it is not zero.

// EDTNodeKey is the fluxvm_edt index of the node's entry (never a service
// id).
const EDTNodeKey = uint32(0)

// Bounds of a pacing rate, in bytes per second: 1 Mbit/s to 100 Gbit/s.
// Below the minimum, the longest packet the datapath paces
// (edtMaxLen) times the nanoseconds a byte takes would overflow.
const (
	MinEDTRate = uint64(125_000)
	MaxEDTRate = uint64(12_500_000_000)
)

// Bounds of a horizon.
const (
	MinEDTHorizon = time.Millisecond
	MaxEDTHorizon = 10 * time.Second
)

// edtMaxLen mirrors FLUXVM_EDT_MAX_LEN: longer packets are paced as this
// long.
const edtMaxLen = 1 << 19

// ErrEDTBounds is returned for a rate or horizon out of bounds.
var ErrEDTBounds = errors.New("EDT setting out of bounds")

// MbpsToEDTRate converts megabits per second (10^6 bit/s, as
// max_egress_mbps) to the datapath's bytes per second.
func MbpsToEDTRate(mbps uint32) uint64 { return uint64(mbps) * 1_000_000 / 8 }

// NewEDTValue is the fluxvm_edt entry of a service paced at rate bytes per
// second with the given horizon; its departure clock starts empty (the
// next packet goes at once). A rate or horizon out of bounds is an error
// (ErrEDTBounds).
func NewEDTValue(rate uint64, horizon time.Duration) (EDTValue, error) {
	if rate < MinEDTRate || rate > MaxEDTRate {
		return EDTValue{}, fmt.Errorf("bpf: EDT rate %d bytes/s: want %d..%d: %w", rate, MinEDTRate, MaxEDTRate, ErrEDTBounds)
	}
	if horizon < MinEDTHorizon || horizon > MaxEDTHorizon {
		return EDTValue{}, fmt.Errorf("bpf: EDT horizon %v: want %v..%v: %w", horizon, MinEDTHorizon, MaxEDTHorizon, ErrEDTBounds)
	}
	// ns_per_byte = 1e9 * 2^32 / rate, rounded up so that the rate is
	// never exceeded.
	hi, lo := bits.Mul64(1_000_000_000, 1<<32)
	q, r := bits.Div64(hi, lo, rate)
	if r != 0 {
		q++
	}
	if hi2, lo2 := bits.Mul64(edtMaxLen, q); hi2 != 0 || lo2 > math.MaxUint64-(1<<32-1) {
		return EDTValue{}, fmt.Errorf("bpf: EDT rate %d bytes/s: a packet's delay would overflow: %w", rate, ErrEDTBounds)
	}
	return EDTValue{Rate: rate, NsPerByte: q, HorizonNs: uint64(horizon.Nanoseconds())}, nil
}

// Delay is how long the datapath schedules a packet of n bytes after the
// previous one at this entry's rate: rounded up, as the datapath does, so
// that no packet leaves earlier than the rate allows.
func (v EDTValue) Delay(n uint32) time.Duration {
	l := uint64(min(n, edtMaxLen))
	hi, lo := bits.Mul64(l, v.NsPerByte)
	lo, carry := bits.Add64(lo, 1<<32-1, 0)
	hi += carry
	return time.Duration(hi<<32 | lo>>32)
}
