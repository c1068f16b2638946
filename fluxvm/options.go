package fluxvm

// OptionsFrom turns a validated configuration into dataplane options. The
// caller may still set InNamespace and Logger.
func OptionsFrom(cfg Config) Options {
	opts := Options{
		Config:      cfg,
		Loader:      cfg.LoaderOptions(),
		CatalogPath: cfg.CatalogPath,
		GCInterval:  cfg.ConntrackGCInterval.Duration,
		Timeouts:    cfg.ConntrackTimeouts(),
	}
	opts.Interfaces = append(opts.Interfaces, cfg.VMEdgeInterfaces...)
	return opts
}
