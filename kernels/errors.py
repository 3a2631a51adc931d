"""Errors the kernels raise for input they cannot run.

`kernels` imports nothing of ours, so this is a `ValueError` of its own; the model
loader turns it into `edge_runtime.errors.UnsupportedModelError`.
"""
from __future__ import annotations


class UnsupportedTensorError(ValueError):
    """A tensor type, or data that does not match its shape, that the kernels cannot run."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
