"""What hostavg needs of each framework, one module per framework: its private APIs, each detected, each with a public fallback.

CPython's and TensorFlow's serve the per-micro-batch path (their public twins cost
Python time per call); Keras's three tell what ``compile`` was given, where a
restored backup resumes and whether fit builds the model first; JAX's tells which
variables the loss uses. One small
function each, in :mod:`~hostavg.compat.python`, :mod:`~hostavg.compat.tensorflow` (with
the public TensorFlow helpers both its backends and the command line share),
:mod:`~hostavg.compat.keras` or :mod:`~hostavg.compat.jax`, imported by the backends
of that framework (``python`` by the engine's signal guard). Importing the module
detects each API on a small probe and makes each wrapper its private form or its
public fallback. CPython's and TensorFlow's fallbacks give the same values (but a
learning rate no apply kernel takes, which the step then reports as None); Keras's
and JAX's do not, as their modules say: ``BackupAndRestore``'s epoch is not resumed,
a model compiled again gets its metrics anew, a variable the loss does not use is
trained on zeros, a dataset may be reshuffled once less than by Keras's fit on JAX. ``HOSTAVG_PUBLIC_API_ONLY=1``, set before hostavg is imported,
makes every wrapper its fallback (``0`` or unset: private where they work).
Standard library only (and hostavg's exceptions). See
docs/explanation/ownership.md for detection, the switch and an example.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from hostavg.core.errors import ArgumentError

__all__ = ["PUBLIC_API_ONLY", "PrivateApi", "apis", "choose", "private_apis", "public_api_only"]

#: The environment variable that, set to ``1``, makes every wrapper its public fallback.
PUBLIC_API_ONLY = "HOSTAVG_PUBLIC_API_ONLY"


class PrivateApi(NamedTuple):
    """One private framework API as hostavg wraps it.

    Attributes:
      name: the private API, as its framework spells it
        (``"tensorflow.DType._is_ref_dtype"``).
      private: the wrapper's form that calls it.
      public: the wrapper's fallback, through public APIs only.
      used: whether this process uses ``private``: it was detected working
        and ``HOSTAVG_PUBLIC_API_ONLY`` is not ``1``.
    """

    name: str
    private: Callable
    public: Callable
    used: bool


_registry: dict[str, PrivateApi] = {}


def public_api_only() -> bool:
    """Whether ``HOSTAVG_PUBLIC_API_ONLY`` is ``1`` (unset, empty or ``0``: False).

    Raises:
      HostavgError: for any other value.
    """
    value = os.environ.get(PUBLIC_API_ONLY, "")
    if value not in ("", "0", "1"):
        raise ArgumentError(f"{PUBLIC_API_ONLY} must be 1 (public APIs only) or 0 (or unset), "
                            f"got {value!r}")
    return value == "1"


def choose(name: str, private: Callable, public: Callable, works: Callable[[], bool]) -> Callable:
    """``private`` if the private API ``name`` works and the switch is off, else ``public``.

    ``works`` is the detection: it returns whether the private API exists and
    behaves (an exception counts as no). It is not called when
    ``HOSTAVG_PUBLIC_API_ONLY=1``. The choice is recorded under ``name`` for
    :func:`private_apis` and :func:`apis`.
    """
    used = not public_api_only() and _works(works)
    _registry[name] = PrivateApi(name, private, public, used)
    return private if used else public


def _works(works: Callable[[], bool]) -> bool:
    try:
        return bool(works())
    except Exception:  # noqa: BLE001 - whatever a probe of a private API raises, it does not work
        return False


def private_apis() -> tuple[str, ...]:
    """The private framework APIs this process uses, sorted by name.

    Covers the frameworks hostavg has imported so far: CPython's ``_signal``
    from ``import hostavg``; Keras's from ``import hostavg.keras``; TensorFlow's
    once its backend is imported (``hostavg.Trainer``, the first
    ``hostavg.keras.Trainer`` on Keras's TensorFlow backend, or
    ``hostavg.import_tensorflow``); JAX's with the
    first on Keras's JAX backend. Empty with ``HOSTAVG_PUBLIC_API_ONLY=1``.

    Example::

        import hostavg
        hostavg.private_apis()  # ('_signal.getsignal', '_signal.signal')
    """
    return tuple(sorted(name for name, api in _registry.items() if api.used))


def apis() -> dict[str, PrivateApi]:
    """Every private API detected so far, by name, used or not (a copy)."""
    return dict(_registry)
