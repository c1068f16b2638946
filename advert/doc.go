// Package advert publishes which service VIPs this node wants routed to it.
//
// FluxVM does not speak BGP. It writes a small JSON file, the advertisement
// snapshot, and routing daemons (FRR, BIRD, or anything that can read a
// file) announce or withdraw the VIPs it lists. The same snapshot is served
// by the REST API at GET /v1/network/services/advertisements. The snapshot
// is a contract: its field names and meanings are stable within a
// [SchemaVersion]; docs/advertisements.md describes it for adapter authors.
//
// # Deciding
//
// A VIP of a service is advertised only when the service's intent says
// advertise=true and the node has at least one Ready backend for that VIP
// (Ready in intent and healthy in the health overlay). Otherwise it is
// withdrawn, and the snapshot says why. [Decide] applies these rules to
// plain values, so the package needs nothing from the dataplane:
//
//	e := advert.Decide(advert.Input{
//		VIP: vip, Service: "web", Exposure: advert.ExposureNorthSouth,
//		Enabled: true, Advertise: true, ReadyBackends: 2,
//	})
//
// # Publishing
//
// A [Publisher] owns one file (by default [DefaultPath]). [Publisher.Publish]
// takes the full list of entries, puts it in a canonical order and compares
// it with what it last published. Only when the content differs does it
// write a new snapshot, with the generation incremented and a new
// timestamp. The write is atomic: a temporary file in the same directory is
// written, synced and renamed over the target, then the directory is
// synced, so a reader sees the old snapshot or the new one, never a mix.
// A new Publisher reads the existing file and continues its generation, so
// restarting the daemon neither rewrites an unchanged snapshot nor moves
// the generation backwards.
//
// Adapters read the file with [Read] (or decode a REST response with
// [Decode]) and usually need only [Snapshot.AdvertisedPrefixes].
//
// The package is pure Go and imports nothing else from this module.
package advert
