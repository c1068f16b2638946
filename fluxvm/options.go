package fluxvm

// OptionsFrom turns a validated configuration into dataplane options. The
// caller may still set InNamespace and Logger.
func OptionsFrom(cfg Config) Options {
	opts := Options{
		Config:      cfg,
		Loader:      cfg.LoaderOptions(),
		CatalogPath: cfg.CatalogPath,
		// Always set by a validated configuration: the daemon publishes
		// the advertisement file.
		AdvertisementsPath: cfg.AdvertisementsPath,
		NodeName:           cfg.NodeName,
		HealthConcurrency:  cfg.HealthCheckConcurrency,
		GCInterval:         cfg.ConntrackGCInterval.Duration,
		Timeouts:           cfg.ConntrackTimeouts(),
		MaglevSeed:         cfg.MaglevSeed,
	}
	opts.Interfaces = append(opts.Interfaces, cfg.VMEdgeInterfaces...)
	return opts
}
