package fluxvm

import (
	"fmt"
	"io"

	"github.com/fluxvm/servicefabric/intent"
)

// The service intent (types, JSON decoding, validation and their errors)
// lives in package intent, which builds on every OS. The names below
// re-export it so that embedders written against package fluxvm keep
// compiling: each type is an alias (fluxvm.Service is intent.Service),
// each constant and error the same value, and the functions that took a
// Config are thin wrappers that pass Config.Node. New code may use
// package intent directly.

// Intent types (aliases of package intent's).
type (
	Service         = intent.Service
	ServicePort     = intent.ServicePort
	Backend         = intent.Backend
	BackendState    = intent.BackendState
	HealthCheck     = intent.HealthCheck
	Exposure        = intent.Exposure
	Mode            = intent.Mode
	Protocol        = intent.Protocol
	Limits          = intent.Limits
	ValidationError = intent.ValidationError
)

// Enumerations of the intent types (package intent's).
const (
	ExposureEastWest   = intent.ExposureEastWest
	ExposureNorthSouth = intent.ExposureNorthSouth
	ExposureBoth       = intent.ExposureBoth

	ModeNAT = intent.ModeNAT
	ModeDSR = intent.ModeDSR

	TCP = intent.TCP
	UDP = intent.UDP

	BackendReady     = intent.BackendReady
	BackendDraining  = intent.BackendDraining
	BackendUnhealthy = intent.BackendUnhealthy

	HealthCheckKindTCP = intent.HealthCheckKindTCP
)

// Bounds and defaults of a service (package intent's).
const (
	MaxRequestBytes       = intent.MaxRequestBytes
	MaxNameLen            = intent.MaxNameLen
	MaxVIPs               = intent.MaxVIPs
	MaxPortsPerService    = intent.MaxPortsPerService
	MaxBackendsPerService = intent.MaxBackendsPerService
	MaxWeight             = intent.MaxWeight
	MaxDrainUntilUnixMs   = intent.MaxDrainUntilUnixMs

	DefaultHealthTimeoutMs          = intent.DefaultHealthTimeoutMs
	DefaultHealthIntervalMs         = intent.DefaultHealthIntervalMs
	DefaultHealthUnhealthyThreshold = intent.DefaultHealthUnhealthyThreshold
	DefaultHealthHealthyThreshold   = intent.DefaultHealthHealthyThreshold
	MinHealthTimeoutMs              = intent.MinHealthTimeoutMs
	MaxHealthTimeoutMs              = intent.MaxHealthTimeoutMs
	MinHealthIntervalMs             = intent.MinHealthIntervalMs
	MaxHealthIntervalMs             = intent.MaxHealthIntervalMs
	MaxHealthThreshold              = intent.MaxHealthThreshold
)

// Refinements of ErrInvalid and ErrLimit (package intent's).
var (
	ErrMalformed    = intent.ErrMalformed
	ErrPrerequisite = intent.ErrPrerequisite
	ErrTooLarge     = intent.ErrTooLarge
	ErrReservedName = intent.ErrReservedName
)

// DecodeService is intent.DecodeService.
func DecodeService(r io.Reader) (Service, error) { return intent.DecodeService(r) }

// DecodeServiceLimit is intent.DecodeServiceLimit.
func DecodeServiceLimit(r io.Reader, maxBytes int64) (Service, error) {
	return intent.DecodeServiceLimit(r, maxBytes)
}

// DecodeServices is intent.DecodeServices.
func DecodeServices(r io.Reader, maxBytes int64) ([]Service, error) {
	return intent.DecodeServices(r, maxBytes)
}

// ValidateService is intent.ValidateService for the node cfg describes
// (cfg.Node()); cfg should itself have passed Config.Validate.
func ValidateService(s Service, cfg Config) error { return intent.ValidateService(s, cfg.Node()) }

// ValidateCatalog is intent.ValidateCatalog for the node cfg describes.
func ValidateCatalog(services []Service, cfg Config, limits Limits) error {
	return intent.ValidateCatalog(services, cfg.Node(), limits)
}

// ReservedNames is intent.ReservedNames.
func ReservedNames() []string { return intent.ReservedNames() }

// IsReservedName is intent.IsReservedName.
func IsReservedName(name string) bool { return intent.IsReservedName(name) }

// Node returns what intent validation needs to know of this node: whether
// it has north-south interfaces, its SNAT address of each family, and
// whether EDT is enabled.
func (c *Config) Node() intent.Node {
	return intent.Node{
		NorthSouth: len(c.NorthSouthInterfaces) > 0,
		SNAT4:      c.SNATAddressFor(false),
		SNAT6:      c.SNATAddressFor(true),
		EDTEnabled: c.EDTEnabled,
	}
}

// verr makes a *ValidationError (see package intent) for the checks of
// this package: configuration keys and interface names.
func verr(kind error, field, format string, args ...any) *ValidationError {
	return &ValidationError{Field: field, Reason: fmt.Sprintf(format, args...), Kind: kind}
}
