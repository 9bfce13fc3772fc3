"""The `optimum-flatten` command line."""
