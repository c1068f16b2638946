package fluxvm

import "time"

// Exported for the external tests of this package (package fluxvm_test),
// which may import fluxvm/api.

// BenchDataplane is benchDataplane (applyscale_test.go): a tier L
// dataplane with services 0..n-1 restored from a catalog on disk.
var BenchDataplane = benchDataplane

// BenchService is benchService: service i with its first backend's
// weight w.
var BenchService = benchService

// BenchEnvInt is benchEnvInt: a benchmark's setting from the environment.
var BenchEnvInt = benchEnvInt

// BenchPct is the p-th fraction percentile of latencies l (latencies.pct).
func BenchPct(l []time.Duration, p float64) time.Duration { return latencies(l).pct(p) }

// BenchOnly is benchOnly: it skips unless FLUXVM_APPLYBENCH=1.
var BenchOnly = benchOnly

// BenchClients is benchClients: n clients at once, per timed operations
// each.
var BenchClients = benchClients
