"""The one exception type hostavg raises for bad input."""

__all__ = ["HostavgError"]


class HostavgError(ValueError):
    """Bad input to hostavg: the message names the culprit and says what to do.

    Raised before anything is changed: when it reaches the caller, the model's
    variables, the optimizer's slots and the global step are as they were.
    A ``ValueError`` subclass, so ``except ValueError`` also catches it.
    """
