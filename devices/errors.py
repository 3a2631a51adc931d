"""Errors a user can cause when asking for a device, backend or profile.

`devices` cannot import `edge_runtime`, so these are `ValueError`s of their own;
the CLI turns them into its one-line `edge-runtime: error: ...` with exit 2.
"""
from __future__ import annotations


class DeviceError(ValueError):
    """An unknown or absent device, a backend that cannot run it, or a bad profile file."""

    code = "device"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
