"""Where actors run: placement groups and bundles, and process-level helpers (ports, Ray tokens)."""
