"""The one error of a config that cannot be used; its message names the key."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""
