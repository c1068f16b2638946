package api

// RoutePatterns lists the ServeMux patterns of the route table, for the
// external tests.
func RoutePatterns() []string {
	out := make([]string, len(routes))
	for i, rt := range routes {
		out[i] = rt.pattern()
	}
	return out
}
