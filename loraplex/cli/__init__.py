"""The `loraplex` command line."""
