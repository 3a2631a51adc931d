"""`edge-runtime bench NAME --json FILE`: each benchmark against its anchor in the same run."""
