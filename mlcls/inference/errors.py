"""The user-facing error of prediction and export; the CLIs print it as one line (exit status 2)."""

from __future__ import annotations


class InferenceError(ValueError):
    """Bad input to prediction or export: no image matched, an invalid threshold, an unusable checkpoint."""
