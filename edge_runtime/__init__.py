"""edge_runtime package."""
