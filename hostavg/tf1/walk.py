"""Walks back through a TF1 graph: which ops a session call runs, and what they read.

A call runs its fetches and, recursively, every op they take an input or a
control input from, except where a tensor is fed: the walk stops there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import tensorflow as tf

from hostavg.core.check import RandomOp

__all__ = ["RANDOM_OPS", "SAVED_STATE", "ops_run", "placeholders_read", "random_ops", "reaches"]


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


#: Op types that draw anew each run, by the call that makes them and its kind
#: (:data:`hostavg.core.check.RANDOM_KINDS`). Stateless ops (``tf.random.stateless_*``) draw
#: the same for the same seed and are not among them. A RandomUniform under a ``dropout``
#: name scope is dropout's.
RANDOM_OPS = {
    "RandomStandardNormal": ("tf.random.normal", "draw"),
    "TruncatedNormal": ("tf.random.truncated_normal", "draw"),
    "ParameterizedTruncatedNormal": ("tf.random.truncated_normal", "draw"),
    "RandomUniform": ("tf.random.uniform", "draw"),
    "RandomUniformInt": ("tf.random.uniform", "draw"),
    "Multinomial": ("tf.random.categorical", "draw"),
    "RandomShuffle": ("tf.random.shuffle", "draw"),
    "RandomGamma": ("tf.random.gamma", "draw"),
    "RandomPoisson": ("tf.random.poisson", "draw"),
    "RandomPoissonV2": ("tf.random.poisson", "draw"),
    "StatefulStandardNormalV2": ("tf.random.Generator.normal", "draw"),
    "StatefulTruncatedNormal": ("tf.random.Generator.truncated_normal", "draw"),
    "StatefulUniform": ("tf.random.Generator.uniform", "draw"),
    "StatefulUniformInt": ("tf.random.Generator.uniform", "draw"),
    "StatefulUniformFullInt": ("tf.random.Generator.uniform_full_int", "draw"),
    "LogUniformCandidateSampler": ("a sampled loss", "sampled"),
    "UniformCandidateSampler": ("a sampled loss", "sampled"),
    "LearnedUnigramCandidateSampler": ("a sampled loss", "sampled"),
    "FixedUnigramCandidateSampler": ("a sampled loss", "sampled"),
    "ThreadUnsafeUnigramCandidateSampler": ("a sampled loss", "sampled"),
}


#: The op types of RANDOM_OPS whose state is a variable (``tf.random.Generator``'s), which a
#: checkpoint holds; every other keeps its state in its kernel, per session.
SAVED_STATE = frozenset({"StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulUniform",
                         "StatefulUniformInt", "StatefulUniformFullInt"})


def random_ops(fetches, fed=()) -> list:
    """The :class:`~hostavg.core.check.RandomOp` that running ``fetches`` runs when ``fed`` are
    fed, sorted by name: what the program called, the tensor drawn, its kind."""
    found = []
    for op in ops_run(_ops(fetches), fed):
        if op.type in RANDOM_OPS:
            api, kind = RANDOM_OPS[op.type]
            if op.type == "RandomUniform" and "dropout" in op.name.lower():
                api, kind = "tf.nn.dropout", "random"
            found.append(RandomOp(api, op.outputs[0].name, kind, op.type in SAVED_STATE))
    return sorted(found, key=lambda r: r.tensor)


def reaches(fetches, fed, types: frozenset) -> bool:
    """Whether running ``fetches`` (tensors and operations) with ``fed`` fed runs an op of ``types``."""
    return any(op.type in types for op in ops_run(_ops(fetches), fed))


def _ops(fetches) -> list:
    """The operations of ``fetches``: an operation or anything with one (a tensor, what a
    variable's assign returns), or a list or tuple of them."""
    if not isinstance(fetches, (list, tuple)):
        fetches = [fetches]
    return [f if isinstance(f, tf.Operation) else f.op for f in fetches]
