"""cloud_fallback package."""
