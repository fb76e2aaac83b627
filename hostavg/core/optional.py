"""Optional dependencies, imported when a call needs them, with an error that says how to get them."""

from __future__ import annotations

from hostavg.core.errors import ArgumentError

__all__ = ["pandas"]


def pandas(what: str):
    """The pandas module, or a HostavgError saying ``what`` needs it."""
    try:
        import pandas as pd
    except ImportError:
        raise ArgumentError(f"{what} needs pandas: pip install pandas") from None
    return pd
