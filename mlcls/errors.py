"""Errors a user fixes by changing the command line or the config (the CLIs print them as one line)."""

from __future__ import annotations


class ConfigError(ValueError):
    """The resolved configuration is invalid; the message says which key and what is expected."""
