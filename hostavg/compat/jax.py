"""JAX's private APIs that hostavg uses, each detected at import, each with a public fallback.

Imported by Keras's JAX backend only (:mod:`hostavg.keras.jax`; it imports
JAX). Each wrapper below is the private form where, when this module is
imported, the private API exists and behaves, and else its public fallback;
with ``HOSTAVG_PUBLIC_API_ONLY=1`` set before hostavg is imported, every
wrapper is its public fallback (see :mod:`hostavg.compat`). Detection traces
one tiny function: it runs nothing on a device.

The wrappers, each with its private API and its public fallback:

* :func:`used_inputs`: the equations of a traced function's jaxpr (the types
  of ``jax.extend.core``, which JAX calls unstable), walked back from an
  output to the inputs it depends on; the fallback says every input is used.
  On JAX a variable the loss does not depend on gets a gradient of zeros, not
  TensorFlow's None: the walk tells the two apart, so such a variable is left
  out of what is trained, as on TensorFlow. With the fallback it is trained
  on zeros: the same weights for an optimizer whose update of a zero gradient
  is zero (SGD, Adam, ...), not for one that decays weights or applies
  constraints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hostavg.compat import choose

__all__ = ["used_inputs"]


def _used_inputs_private(closed_jaxpr, output: int = 0) -> tuple[bool, ...]:
    """Whether output ``output`` of ``closed_jaxpr`` depends on each of its inputs, in order.

    A walk back over the equations from that output: an equation any of whose
    outputs is needed needs all its inputs (an equation holding a sub-jaxpr
    counts as a whole, so the answer may say used where it is not, never the
    reverse).
    """
    from jax.extend.core import Var
    jaxpr = closed_jaxpr.jaxpr
    needed = {v for v in jaxpr.outvars[output:output + 1] if isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if isinstance(v, Var))
    return tuple(v in needed for v in jaxpr.invars)


def _used_inputs_public(closed_jaxpr, output: int = 0) -> tuple[bool, ...]:
    """Every input counts as used (JAX's gradient of an unused one is zeros)."""
    return (True,) * len(closed_jaxpr.jaxpr.invars)


def _used_inputs_works() -> bool:
    probe = jax.make_jaxpr(lambda a, b, c: ((a * c).sum(), b))(
        jnp.zeros(2), jnp.zeros(3), jnp.zeros(2))
    return _used_inputs_private(probe) == (True, False, True)


used_inputs = choose("jax.extend.core.Jaxpr (walked back from the loss)", _used_inputs_private,
                     _used_inputs_public, _used_inputs_works)
