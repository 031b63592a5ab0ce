"""The public gateway: validates, tokenizes, resolves adapters, routes to compute."""
