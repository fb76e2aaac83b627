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


def placeholders_read(op, fed=(), with_default: bool = True) -> list:
    """The placeholders that running ``op`` reads when ``fed`` (tensors) are fed, by name.

    ``with_default``: count placeholders with a default too (read, though
    they need no feed).
    """
    kinds = ("Placeholder", "PlaceholderWithDefault") if with_default else ("Placeholder",)
    found = [o for o in ops_run([op], fed) if o.type in kinds]
    return [op.outputs[0] for op in sorted(found, key=lambda o: o.name)]


def reaches(fetches, fed, types: frozenset) -> bool:
    """Whether running ``fetches`` (tensors and operations) with ``fed`` fed runs an op of ``types``."""
    ops = [f.op if isinstance(f, tf.Tensor) else f for f in fetches]
    return any(op.type in types for op in ops_run(ops, fed))
