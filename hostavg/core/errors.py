"""The exceptions hostavg raises for what it refuses, and the small checks that raise them."""

import contextlib
import math
import numbers
import re
import sys
import warnings
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["ArgumentError", "HostavgError", "StepError", "flag", "non_negative_int",
           "non_negative_number", "object_list", "positive_int", "positive_number", "refused",
           "short", "warn", "within_step"]


class HostavgError(Exception):
    """What hostavg raises for what it refuses: the message names the culprit and says what to do.

    The base of :class:`ArgumentError` (refused before anything ran) and
    :class:`StepError` (failed while it ran): ``except HostavgError`` catches
    both. When one reaches the caller, the model's variables, the optimizer's
    state, the global step and the records are as they were.

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


class ArgumentError(HostavgError, ValueError):
    """A call refused before anything ran: an argument, the data's form (keys, shapes, lengths,
    dtypes, targets out of range), a hook, callback, statistic or file given, or a call made
    before what it needs. Also a ``ValueError``. See docs/explanation/errors.md."""


class StepError(HostavgError, RuntimeError):
    """A failure while a step (or a compute, an apply, a check, fit) ran: non-finite values, a
    compute the framework refused, a closed session, a step already running, a hook or
    statistic that failed, ranks out of step, a checkpoint fit could not write. Also a
    ``RuntimeError``. See docs/explanation/errors.md."""


@contextlib.contextmanager
def within_step():
    """Within the block, an :class:`ArgumentError` is raised as a :class:`StepError` with the
    same message and culprits: what a hook or statistic returns while a step runs (gradients
    of the wrong shape) is no argument of the call's."""
    try:
        yield
    except ArgumentError as e:
        error = StepError(*e.args)
        error.culprits, error.culprit_rows = e.culprits, e.culprit_rows
        raise error from e.__cause__


def refused(fact: str, advice: str, kind: type = StepError) -> HostavgError:
    """A ``kind`` of HostavgError saying ``fact`` (what the framework refused), then ``advice``
    (what to check), with the fact alone kept as its ``fact``: a caller that knows the cause
    (a batch size fixed in the model) says it first, then the fact, without advice that
    misleads. ``kind``: :class:`StepError` where the framework refused to run, or
    :class:`ArgumentError` where it refused to build the model on a batch's form, before
    anything ran."""
    error = kind(f"{fact}; {advice}")
    error.fact = fact
    return error


def short(value: float) -> str:
    """A number in 3 digits for a message, exponents as ``1e30``, ``1e4``, ``1e-5``."""
    return re.sub(r"e\+?(-?)0*(\d)", r"e\1\2", f"{float(value):.3g}")


def positive_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 1 (a NumPy integer too, not a bool); else ArgumentError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ArgumentError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    """``value`` as an int if it is an integer >= 0 (a NumPy integer too, not a bool); else ArgumentError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ArgumentError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def positive_number(name: str, value) -> float:
    """``value`` as a float if it is a real number (NumPy's too; not a bool, not complex) that is
    finite and > 0 as a float64; else ArgumentError naming ``name``."""
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
        raise ArgumentError(f"{name} must be a finite number {rule}, got {value!r}")
    return number


def flag(name: str, value) -> bool:
    """``value`` if it is True or False (a NumPy bool too); else ArgumentError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def object_list(name: str, value, methods: tuple, example: str) -> tuple:
    """``value``, a list of objects that each have one of ``methods`` (None: none), as a tuple.

    Raises ArgumentError naming ``name`` (plural: "hooks") for anything else,
    such as one such object not in a list, echoing the value.
    """
    def fits(obj):
        return any(callable(getattr(obj, m, None)) for m in methods)

    value = () if value is None else value
    if isinstance(value, (Mapping, str)) or not isinstance(value, Iterable) or fits(value):
        raise ArgumentError(f"{name} must be a list of objects with {' or '.join(methods)} (or "
                            f"None), got {value!r}; e.g. {name}=[{example}]")
    value = tuple(value)
    for obj in value:
        if not fits(obj):
            raise ArgumentError(f"{name[:-1]} {obj!r} has none of the methods {methods}")
    return value


def warn(warning: Warning) -> None:
    """Warns ``warning`` at the first frame outside hostavg: the user's line that called fit
    or step, not the hook inside it."""
    package = __name__.split(".")[0]
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == package:
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level)
