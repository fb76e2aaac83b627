"""The one exception type hostavg raises for bad input."""

import numbers

__all__ = ["HostavgError", "positive_int"]


class HostavgError(ValueError):
    """Bad input to hostavg: the message names the culprit and says what to do.

    Raised before anything is changed: when it reaches the caller, the model's
    variables, the optimizer's slots and the global step are as they were.
    A ``ValueError`` subclass, so ``except ValueError`` also catches it.
    """


def positive_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 1 (a NumPy integer too, not a bool); else HostavgError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise HostavgError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)
