"""Calling hooks: the one hook protocol (:class:`~hostavg.core.results.Hook`) as the engine runs it."""

from __future__ import annotations

import contextlib

from hostavg.core.blas import need_one_blas_thread
from hostavg.core.errors import object_list
from hostavg.core.results import HOOK_METHODS

__all__ = ["call", "methods", "name_of", "normalize_hooks"]


def normalize_hooks(hooks) -> tuple:
    """``hooks`` (a list of hooks, or None for none) as a tuple, each checked to be a hook."""
    return object_list("hooks", hooks, HOOK_METHODS, "hostavg.hooks.SkipNonFinite()")


def call(hook, method, args, where: str, applied=None):
    """``method(*args)``; an exception it raises propagates as it is, with a note naming the hook.

    ``applied``: the StepResult of the step applied before the hook ran (an ``on_applied``
    hook's), kept as the exception's ``.applied`` so that the caller can count the step.
    A hook runs NumPy's BLAS in one thread (:mod:`hostavg.core.blas`); hostavg's own watches,
    whose class marks ``_hostavg_no_blas`` (not a subclass of them, which may add its own BLAS
    calls), call BLAS only through hostavg's arithmetic, which holds it.
    """
    if not vars(type(hook)).get("_hostavg_no_blas", False):
        need_one_blas_thread()
    try:
        return method(*args)
    except Exception as e:
        e.add_note(f"hostavg: raised by hook {name_of(hook)} in {where}; "
                   f"{'nothing was applied' if applied is None else 'the step was applied'}")
        if applied is not None:
            with contextlib.suppress(AttributeError):  # an exception type with __slots__
                e.applied = applied
        raise


def methods(hooks, name: str) -> list:
    return [(h, getattr(h, name)) for h in hooks if callable(getattr(h, name, None))]


def name_of(hook) -> str:
    return type(hook).__name__
