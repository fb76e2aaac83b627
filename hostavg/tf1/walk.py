"""Walks back through a TF1 graph: which ops a session call runs, and what they read.

A call runs its fetches and, recursively, every op they take an input or a
control input from, except where a tensor is fed: the walk stops there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import tensorflow as tf

__all__ = ["ops_run", "placeholders_read", "reaches"]


def ops_run(ops: Iterable, fed=()) -> Iterator:
    """Every op that running ``ops`` runs when ``fed`` (tensors) are fed: a walk back through
    inputs and control inputs, stopping at fed tensors."""
    fed, seen, todo = set(fed), set(), list(ops)
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        yield op
        todo.extend(t.op for t in op.inputs if t not in fed)
        todo.extend(op.control_inputs)


def placeholders_read(fetches, fed=(), with_default: bool = True) -> list:
    """The placeholders that running ``fetches`` (an operation or a tensor, or a list of them)
    reads when ``fed`` (tensors) are fed, sorted by name.

    ``with_default``: count placeholders with a default too (read, though
    they need no feed).
    """
    kinds = ("Placeholder", "PlaceholderWithDefault") if with_default else ("Placeholder",)
    found = [o for o in ops_run(_ops(fetches), fed) if o.type in kinds]
    return [op.outputs[0] for op in sorted(found, key=lambda o: o.name)]


def reaches(fetches, fed, types: frozenset) -> bool:
    """Whether running ``fetches`` (tensors and operations) with ``fed`` fed runs an op of ``types``."""
    return any(op.type in types for op in ops_run(_ops(fetches), fed))


def _ops(fetches) -> list:
    """The operations of ``fetches``: an operation or anything with one (a tensor, what a
    variable's assign returns), or a list or tuple of them."""
    if not isinstance(fetches, (list, tuple)):
        fetches = [fetches]
    return [f if isinstance(f, tf.Operation) else f.op for f in fetches]
