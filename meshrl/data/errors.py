"""The one error type of the data layer: a dataset file that cannot be used as it is."""

from __future__ import annotations


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file (and row or column)."""
