"""The response cache: exact and semantic hits in front of the router (response_cache.py), its SQLite store,
the guards a similarity score misses, the embedders, and the threshold's calibration on a labelled set."""
from edge_runtime.cache.response_cache import ResponseCache

__all__ = ["ResponseCache"]
