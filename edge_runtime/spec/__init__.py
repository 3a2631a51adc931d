"""Speculative decoding: drafters (n-gram prompt lookup, MTP heads) and their verification."""
