// Package scenario runs end-to-end scenarios on a lab topology: the demo
// behind `fluxvm-lab demo`, the side-by-side performance runs behind
// `fluxvm-lab perf`, and the end-to-end tests. Everything happens in
// namespaces the lab creates; Close removes them, the pin root and every
// attachment, also after a failure.
//
// It needs Linux (network namespaces, veths, BPF); elsewhere the package is empty.
package scenario
