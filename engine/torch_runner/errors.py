"""Errors of the torch runner (torch-free, so the CLI can catch them without importing torch)."""

from __future__ import annotations

from kvplane.errors import KvplaneError


class CheckpointError(KvplaneError):
    """A model directory is missing, malformed, or describes an architecture we do not run."""


class KvCacheError(KvplaneError):
    """The KV cache cannot be sized or addressed as asked (too small, a block out of range)."""


class InvalidBatchError(KvplaneError):
    """A scheduled step the model cannot compute (a token outside the vocabulary, a position
    past the model's context); the scheduler should have refused the request before."""
