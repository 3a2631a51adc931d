"""Typed exceptions for everything a user can get wrong.

Every error a user can cause (a bad path, a file that is not a GGUF, a prompt
that does not fit, a sampling value out of range) is one of these, so the CLI
prints a one-line message and the servers map it to an error code. Internal
invariants use asserts instead.
"""
from __future__ import annotations


class EdgeRuntimeError(Exception):
    """Base of all user-facing errors. `code` is stable and machine-readable."""

    code = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ModelFileError(EdgeRuntimeError):
    """Missing, unreadable, not-a-GGUF or truncated model file."""

    code = "model_file"


class UnsupportedModelError(EdgeRuntimeError):
    """A GGUF we can read but cannot run (architecture or tensor type)."""

    code = "unsupported_model"


class ContextLengthError(EdgeRuntimeError):
    """The prompt (plus what must be generated) does not fit the context window."""

    code = "context_length_exceeded"


class InvalidRequestError(EdgeRuntimeError):
    """Invalid sampling values or request fields."""

    code = "invalid_request"


class BackendUnavailableError(EdgeRuntimeError):
    """A backend that cannot run here (missing package, unknown name)."""

    code = "backend_unavailable"
