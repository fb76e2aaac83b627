"""Walks back through a TF1 graph: which ops a session call runs, and what they read.

A call runs its fetches and, recursively, every op they take an input or a
control input from, except where a tensor is fed: the walk stops there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import tensorflow as tf

from hostavg.core.check import RandomOp

__all__ = ["RANDOM_OPS", "SAVED_STATE", "SELECT_OPS", "ops_run", "placeholders_read", "random_ops",
           "reaches", "switches"]


def ops_run(ops: Iterable, fed=(), skipped=frozenset()) -> Iterator:
    """Every op that running ``ops`` runs when ``fed`` (tensors) are fed: a walk back through
    inputs and control inputs, stopping at fed tensors; ``skipped``: ops whose control edges
    are not followed (an op only waited for, left out)."""
    fed, seen, todo = set(fed), set(), list(ops)
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        yield op
        todo.extend(t.op for t in op.inputs if t not in fed)
        todo.extend(c for c in op.control_inputs if c not in skipped)


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


#: Op types that pick between their inputs by a predicate (``tf.cond``, ``tf.where``), by the
#: predicate's input index.
SELECT_OPS = {"If": 0, "StatelessIf": 0, "Select": 0, "SelectV2": 0, "Switch": 1}

#: Op types that pass a variable on (its value or handle): through them a read is still its.
PASS_OPS = frozenset({"Identity", "ReadVariableOp", "Enter", "Snapshot"})


def switches(fetches, dropout: list, moving: frozenset) -> dict:
    """The training-mode switches among the scalar placeholders that running ``fetches`` reads:
    name -> the kinds it switches, a sorted tuple of "batch norm" and "dropout".

    A placeholder switches dropout when it reaches, by a scalar, where the draws of
    ``dropout`` (operations) meet the rate (a keep_prob, a rate, or a ``tf.cond`` on a
    training flag that gives one: :func:`_beside`), and batch norm when it decides a
    pick (:data:`SELECT_OPS`) of which an input is read from a variable of ``moving`` (the
    moving statistics' ops, as the UPDATE_OPS assign them).
    """
    found = {}
    for random in dropout:
        for scalar in _beside(random):
            for p in placeholders_read(scalar):
                if p.shape.rank in (None, 0):
                    found.setdefault(p.name, set()).add("dropout")
    for p in placeholders_read(fetches):
        if p.shape.rank in (None, 0) and _picks_moving(p.op, moving):
            found.setdefault(p.name, set()).add("batch norm")
    return {name: tuple(sorted(found[name])) for name in sorted(found)}


#: Where a dropout's draw meets its rate (``draw >= rate``; ``floor(keep_prob + draw)``).
_COMPARISONS = frozenset({"GreaterEqual", "Greater", "Less", "LessEqual", "Floor"})


def _beside(random) -> list:
    """The scalar tensors (rank 0 or unknown) combined with ``random``'s draw up to where it
    meets the rate (:data:`_COMPARISONS`, at most 3 ops on), not themselves drawn from it: a
    dropout's rate or keep_prob."""
    drawn, todo, out = {random}, [(random, 0)], []
    while todo:
        op, depth = todo.pop()
        if depth == 3 or op.type in _COMPARISONS:
            continue
        for consumer in {c for t in op.outputs for c in t.consumers()}:
            if consumer not in drawn:
                drawn.add(consumer)
                todo.append((consumer, depth + 1))
    for op in drawn - {random}:
        out.extend(t for t in op.inputs if t.op not in drawn and t.shape.rank in (None, 0))
    return out


def _picks_moving(switch, moving: frozenset) -> bool:
    """Whether ``switch`` (an operation) decides a pick between inputs of which one is read
    from a variable of ``moving``."""
    after, todo = {switch}, [switch]
    while todo:
        for consumer in {c for t in todo.pop().outputs for c in t.consumers()}:
            if consumer not in after:
                after.add(consumer)
                todo.append(consumer)
    for op in after:
        if op.type in SELECT_OPS and op.inputs[SELECT_OPS[op.type]].op in after:
            for i, t in enumerate(op.inputs):
                source = t.op
                while source.type in PASS_OPS and source.inputs:
                    source = source.inputs[0].op
                if i != SELECT_OPS[op.type] and source in moving:
                    return True
    return False


def reaches(fetches, fed, types: frozenset) -> bool:
    """Whether running ``fetches`` (tensors and operations) with ``fed`` fed runs an op of ``types``."""
    return any(op.type in types for op in ops_run(_ops(fetches), fed))


def _ops(fetches) -> list:
    """The operations of ``fetches``: an operation or anything with one (a tensor, what a
    variable's assign returns), or a list or tuple of them."""
    if not isinstance(fetches, (list, tuple)):
        fetches = [fetches]
    return [f if isinstance(f, tf.Operation) else f.op for f in fetches]
