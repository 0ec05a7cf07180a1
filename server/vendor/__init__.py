"""Vendored build-time scripts (never imported by the server at run time)."""
