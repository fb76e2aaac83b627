"""The one exception type hostavg raises for bad input."""

import math
import numbers
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["HostavgError", "flag", "non_negative_int", "non_negative_number", "object_list",
           "positive_int", "positive_number", "refused"]


class HostavgError(ValueError):
    """Bad input to hostavg: the message names the culprit and says what to do.

    Raised before anything is changed: when it reaches the caller, the model's
    variables, the optimizer's slots and the global step are as they were.
    A ``ValueError`` subclass, so ``except ValueError`` also catches it.

    Attributes:
      culprits: the :class:`~hostavg.core.results.Culprit` samples that made
        a step fail (non-finite, blowing the apply up, or refused by the
        framework), sorted; () where none apply.
      culprit_rows: their data rows, sorted (ints); ``[]`` where none apply
        or the step was not told its rows.
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.culprits, self.culprit_rows = (), []


def refused(fact: str, advice: str) -> HostavgError:
    """A HostavgError saying ``fact`` (what the framework refused), then ``advice`` (what to
    check), with the fact alone kept as its ``fact``: a caller that knows the cause (a batch
    size fixed in the graph) says it first, then the fact, without advice that misleads."""
    error = HostavgError(f"{fact}; {advice}")
    error.fact = fact
    return error


def positive_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 1 (a NumPy integer too, not a bool); else HostavgError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise HostavgError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 0 (a NumPy integer too, not a bool); else HostavgError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise HostavgError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def positive_number(name: str, value) -> float:
    """``value`` as a float if it is a real number (NumPy's too; not a bool, not complex) that is
    finite and > 0 as a float64; else HostavgError naming ``name``."""
    return _real(name, value, "> 0", lambda x: x > 0)


def non_negative_number(name: str, value) -> float:
    """``value`` as a float if it is a real number that is finite and >= 0 (see :func:`positive_number`)."""
    return _real(name, value, ">= 0", lambda x: x >= 0)


def _real(name: str, value, rule: str, holds) -> float:
    try:
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) \
            else math.nan
    except OverflowError:  # an int beyond float64's range
        number = math.inf
    if not (math.isfinite(number) and holds(number)):
        raise HostavgError(f"{name} must be a finite number {rule}, got {value!r}")
    return number


def flag(name: str, value) -> bool:
    """``value`` if it is True or False (a NumPy bool too); else HostavgError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise HostavgError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def object_list(name: str, value, methods: tuple, example: str) -> tuple:
    """``value``, a list of objects that each have one of ``methods`` (None: none), as a tuple.

    Raises HostavgError naming ``name`` (plural: "hooks") for anything else,
    such as one such object not in a list, echoing the value.
    """
    def fits(obj):
        return any(callable(getattr(obj, m, None)) for m in methods)

    value = () if value is None else value
    if isinstance(value, (Mapping, str)) or not isinstance(value, Iterable) or fits(value):
        raise HostavgError(f"{name} must be a list of objects with {' or '.join(methods)} (or "
                           f"None), got {value!r}; e.g. {name}=[{example}]")
    value = tuple(value)
    for obj in value:
        if not fits(obj):
            raise HostavgError(f"{name[:-1]} {obj!r} has none of the methods {methods}")
    return value
