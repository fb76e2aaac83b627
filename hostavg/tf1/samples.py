"""Each sample of a feed computed alone, many per session call (``per_sample`` on the TF1 face).

A TF1 loss is one tensor of the whole feed, so it cannot be called on one sample as a
Keras model can. Its subgraph (the ops the loss runs, stopping at the fed tensors) is
imported again inside ``tf.vectorized_map``, once per sample, with each fed array mapped to
that sample's row (a batch of one), every other fed tensor to itself and every variable
handle to the graph's own, so that the copy reads the same variables and the same feed.
Its gradients, taken with respect to the copy's reads of each trained variable, are the
sample's alone, as the trainer's compute of a batch of one gives them. One function per
feed signature and kind (the first pass's sums, with or without each sample's dot with
their sum; the second pass's dots with a fed mean) is built into the graph on its first call.

Vectorizing refuses (:class:`~hostavg.engine.protocols.NotVectorized`, saying why: the
engine then computes each sample in a call of its own) a loss that runs a stateful op
other than a variable's read (random draws, assignments, tables, iterators), a sparse
gradient (each sample's would be the whole table), a reference variable, an optimizer
whose ``compute_gradients`` is its own, a finalized graph, a feed whose arrays differ in
length (blocks), and any op ``tf.vectorized_map`` has no rule for.
"""

from __future__ import annotations

import math

import tensorflow as tf

from hostavg.compat.tensorflow import first_line, sample_squares
from hostavg.core.convolution import kernel_gradients, same_padding
from hostavg.engine.protocols import NotVectorized
from hostavg.tf1.walk import ops_run

__all__ = ["Vectorized", "build", "refusal"]

v1 = tf.compat.v1

#: Stateful op types the imported loss may run: a variable's handle and its reads.
READS = frozenset({"VarHandleOp", "ReadVariableOp"})
#: Assignments the loss may wait for without reading what they assign: left out.
ASSIGNS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


class Vectorized:
    """A trainer's vectorized samples: :func:`build`'s functions, one per feed signature
    (its keys, which of them hold rows) and kind, built on first use and kept."""

    def __init__(self, loss, trained: list, optimizer, pairs: list):
        self.loss, self.trained = loss, trained
        self.refused = refusal(optimizer, pairs)
        self._built = {}  # signature -> (fetches, mean placeholders), or its NotVectorized

    def fetches(self, feed: dict, kind: str) -> tuple[list, tuple]:
        """:func:`build` of ``feed``'s signature and ``kind``, built once; raises
        NotVectorized (again, where it did before)."""
        if self.refused:
            raise NotVectorized(self.refused)
        signature = (tuple(feed), tuple(value.ndim > 0 for value in feed.values()), kind)
        built = self._built.get(signature)
        if built is None:
            try:
                built = build(self.loss, self.trained, feed, kind)
            except NotVectorized as e:
                built = e
            except Exception as e:  # noqa: BLE001 - a graph this module does not foresee
                built = NotVectorized(f"building the vectorized samples failed "
                                      f"({type(e).__name__}: {first_line(e)})")
            self._built[signature] = built
        if isinstance(built, NotVectorized):
            raise built
        return built


def refusal(optimizer, pairs: list) -> str | None:
    """Why the trainer's samples cannot be vectorized whatever the feed (``pairs``: the
    optimizer's (gradient, variable) pairs), or None."""
    if type(optimizer).compute_gradients is not v1.train.Optimizer.compute_gradients:
        return (f"{type(optimizer).__name__} computes its own gradients (compute_gradients), "
                f"which a vectorized sample would not")
    for g, v in pairs:
        if isinstance(g, tf.IndexedSlices):
            return (f"{v.op.name!r} has a sparse gradient (an embedding's rows), and each "
                    f"sample's would be the whole table")
        if getattr(v, "handle", None) is None or v.handle.op.type != "VarHandleOp":
            return f"{v.op.name!r} is a reference variable, not a resource variable"
    return None


def build(loss, trained: list, feed: dict, kind: str) -> tuple[list, tuple]:
    """(fetches, mean placeholders): for ``kind`` "sums" [losses (n,), squared norms (n,)
    float64, each trained variable's gradient summed over the samples], for "dots" [g_i . mean
    (n,) float64], for "own" the sums' and g_i . their sum, fed ``feed``'s keys (then, for
    "dots", a float64 placeholder per trained variable, its mean). Built in the loss's graph;
    raises NotVectorized."""
    graph = loss.graph
    if graph.finalized:
        raise NotVectorized("the graph is finalized, and the vectorized samples are new ops")
    lengths = {len(value) for value in feed.values() if value.ndim}
    if len(lengths) != 1:
        raise NotVectorized("the feed's arrays differ in length (blocks of rows per sample)")
    batched = [key for key, value in feed.items() if value.ndim]
    rowed = {id(key) for key in batched}
    nodes, reads = _subgraph(loss, trained, tuple(feed))
    taps = _candidates(nodes, reads)
    with graph.as_default(), tf.name_scope("hostavg_per_sample"):
        means = tuple(v1.placeholder(tf.float64, v.shape, name="mean") for v in trained) \
            if kind == "dots" else ()
        shared = {t.name: t for t in feed if id(t) not in rowed}  # fed to the session call
        handles = {op.outputs[0].name: op.outputs[0] for op in nodes.values()
                   if op.type == "VarHandleOp"}  # the graph's own variables
        definition = _definition(graph, nodes)
        consumed, tapped = _inputs(definition), []  # tapped: what _one tapped, as it traced

        def one(rows):
            mapped = {**shared, **handles, **{t.name: row[None] for t, row in zip(batched, rows)}}
            out = tf.graph_util.import_graph_def(
                definition, input_map={n: t for n, t in mapped.items() if n in consumed},
                return_elements=[loss.name, *(name for _, name in reads),
                                 *(f"{op.name}:0" for op in taps.values()),
                                 *(op.inputs[0].name for op in taps.values())], name="sample")
            return _one(out, reads, taps, trained, tapped)

        try:
            losses, formed, inputs, deltas = tf.vectorized_map(one, batched,
                                                               fallback_to_while_loop=False)
        except Exception as e:  # noqa: BLE001 - pfor's refusals come as several types
            raise NotVectorized(f"tf.vectorized_map of the loss's subgraph failed "
                                f"({type(e).__name__}: {first_line(e)})") from e
        formed = dict(zip([i for i in range(len(trained)) if i not in tapped], formed))
        products = {}  # a MatMul's a and delta
        for i, a, d in zip(tapped, inputs, deltas):
            if taps[i].type == "Conv2D":
                formed[i] = _convolved(taps[i], a, d)
            else:
                products[i] = (a, d)
        return _reduced(kind, losses, formed, products, trained, means), means


def _candidates(nodes: dict, reads: list) -> dict:
    """Trained variable index -> the op that is the loss's only use of it, as its right
    operand: an untransposed MatMul (its gradient a^T delta need not be formed where a is one
    row) or a Conv2D, NHWC (its gradient formed per kernel offset:
    :mod:`hostavg.core.convolution`)."""
    counts, out = {}, {}
    for i, _ in reads:
        counts[i] = counts.get(i, 0) + 1
    users = {}
    for op in nodes.values():
        for t in op.inputs:
            users.setdefault(t.name, []).append(op)
    for i, name in reads:
        used = users.get(name, [])
        if counts[i] != 1 or len(used) != 1 or len(used[0].inputs) != 2 \
                or used[0].inputs[1].name != name or used[0].inputs[0].name == name:
            continue  # read twice, or not as the right operand of a binary op
        op = used[0]
        if op.type == "MatMul" and not op.get_attr("transpose_a") \
                and not op.get_attr("transpose_b"):
            out[i] = op
        elif op.type == "Conv2D" and op.get_attr("data_format") == b"NHWC":
            out[i] = op
    return out


def _one(out: list, reads: list, taps: dict, trained: list, chosen: list) -> tuple:
    """One sample's (loss, [each untapped variable's gradient, flat], [each tapped op's input
    a], [the loss's gradient delta at its output]) from the imported ``out``: the loss, the
    reads, then each candidate tap's output and input. A candidate is tapped where its input
    is the sample's one row (not a sequence's rows) or image, of known shape; ``chosen`` gets
    the tapped indices, in order."""
    loss, rest = out[0], out[1:]
    read_values, rest = rest[:len(reads)], rest[len(reads):]
    outputs, inputs = rest[:len(taps)], rest[len(taps):]
    tapped = {i: (z, a) for (i, op), z, a in zip(taps.items(), outputs, inputs)
              if a.shape.rank == (2 if op.type == "MatMul" else 4) and a.shape[0] == 1
              and a.shape.is_fully_defined() and z.shape.is_fully_defined()}
    chosen[:] = list(tapped)
    xs = [t for (i, _), t in zip(reads, read_values) if i not in tapped]
    xs += [z for z, _ in tapped.values()]
    grads = tf.gradients(loss, xs)
    deltas = grads[len(xs) - len(tapped):]
    formed = _gradients([i for i, _ in reads if i not in tapped], grads, trained, tapped)
    return (loss, [tf.reshape(g, [-1]) for g in formed],
            [a[0] for _, a in tapped.values()],
            [tf.zeros(z.shape[1:], z.dtype) if d is None else d[0]
             for (z, _), d in zip(tapped.values(), deltas)])


def _convolved(op, a, d):
    """(n, kernel size) each sample's kernel gradient of the Conv2D ``op`` from its inputs
    ``a`` (n, H, W, C) and deltas ``d`` (n, OH, OW, O)."""
    kernel = tuple(op.inputs[1].shape.as_list())
    strides, dilations = op.get_attr("strides")[1:3], op.get_attr("dilations")[1:3]
    kind = op.get_attr("padding")
    if kind == b"SAME":
        padding = same_padding(a.shape[1:3], d.shape[1:3], kernel[:2], strides, dilations)
    elif kind == b"EXPLICIT":  # [before, after] per axis of NHWC
        given = op.get_attr("explicit_paddings")
        padding = [tuple(given[2:4]), tuple(given[4:6])]
    else:
        padding = None
    grads = kernel_gradients(a, d, kernel, strides, dilations, padding, tf)
    return tf.reshape(grads, [-1, math.prod(kernel)])


def _outer_squares(a, d):
    """(n,) float64: each sample's |a|^2 |delta|^2, the squared norm of its gradient a^T delta
    (``a`` (n, d), ``d`` (n, units)); Inf where an entry a_j delta_k would overflow the
    variables' dtype, as the gradient formed alone would."""
    big = a.dtype.max
    wide = [tf.cast(x, tf.float64) for x in (a, d)]
    peak = tf.reduce_max(tf.abs(wide[0]), 1) * tf.reduce_max(tf.abs(wide[1]), 1)
    sq = tf.reduce_sum(tf.square(wide[0]), 1) * tf.reduce_sum(tf.square(wide[1]), 1)
    return tf.where(peak > big, tf.constant(float("inf"), tf.float64), sq)


def _reduced(kind: str, losses, formed: dict, tapped: dict, trained: list, means: tuple) -> list:
    """The fetches of :func:`build` from the vectorized samples: ``formed`` index -> the
    variable's (n, size) gradients, ``tapped`` index -> (A (n, d), Delta (n, units)) of a
    MatMul, for every trained variable."""
    if kind == "dots":
        return [_dots(formed, tapped, means)]
    if kind == "own":  # each sum divided by its largest magnitude, times it after
        out = _reduced("sums", losses, formed, tapped, trained, ())
        tops = [tf.where(t > 0, t, tf.ones_like(t)) for t in
                (tf.reduce_max(tf.abs(s)) for s in out[2:])]
        return [*out, _dots(formed, tapped, [s / t for s, t in zip(out[2:], tops)],
                            [tf.cast(t, tf.float64) for t in tops])]
    sq = sample_squares(tf.add_n([tf.zeros_like(losses, tf.float64),
                                  *(_outer_squares(a, d) for a, d in tapped.values())]),
                        list(formed.values()))
    sums = {i: tf.reduce_sum(g, 0) for i, g in formed.items()}
    sums.update((i, tf.matmul(a, d, transpose_a=True)) for i, (a, d) in tapped.items())
    return [losses, sq, *(tf.reshape(sums[i], v.shape) for i, v in enumerate(trained))]


def _dots(formed: dict, tapped: dict, means, scales=None):
    """(n,) float64 g_i . mean of each sample (of :func:`_reduced`'s ``formed`` and
    ``tapped``; ``means``: per trained variable, a fed float64 mean or the samples' sum, each
    times its float64 ``scales`` where given), in the variables' dtype, as the other faces'
    forward mode."""
    parts = {i: tf.reduce_sum(g * tf.cast(tf.reshape(means[i], [1, -1]), g.dtype), 1)
             for i, g in formed.items()}
    parts.update((i, tf.reduce_sum(tf.matmul(a, tf.cast(means[i], a.dtype)) * d, 1))
                 for i, (a, d) in tapped.items())
    return tf.add_n([tf.cast(p, tf.float64) * (1.0 if scales is None else scales[i])
                     for i, p in parts.items()])


def _subgraph(loss, trained: list, fed: tuple) -> tuple[dict, list]:
    """(name -> op the loss runs when ``fed`` are fed, [(a trained variable's index, the name
    "op:0" of one of its reads)], several per variable where the loss reads it more than once).
    An assignment the loss only waits for (a control input: a counter, a moving average), to a
    variable the rest does not read, is left out, as the other faces' stateless calls drop what
    the forward pass assigns."""
    ran = list(ops_run([loss.op], fed))
    consumed = {t.op for op in ran for t in op.inputs}
    dropped = {op for op in ran if op.type in ASSIGNS and op not in consumed}
    nodes = {op.name: op for op in ops_run([loss.op], fed, dropped)}
    read = {op.inputs[0].op for op in nodes.values() if op.type == "ReadVariableOp"}
    kept = sorted(op.name for op in dropped if op.inputs[0].op in read)
    if kept:
        raise NotVectorized(f"the loss waits for assignments to variables it reads "
                            f"({', '.join(kept[:3])}), which each sample would make again")
    stateful = sorted({op.type for op in nodes.values()
                       if op._is_stateful and op.type not in READS})  # noqa: SLF001
    if stateful:
        raise NotVectorized(f"the loss runs stateful ops ({', '.join(stateful)}), which each "
                            f"sample would run again")
    index = {v.handle.op.name: i for i, v in enumerate(trained)}
    reads = []
    for op in nodes.values():
        for t in op.inputs:
            if t.op.name not in index:
                continue
            if op.type != "ReadVariableOp":
                raise NotVectorized(f"{op.type} {op.name!r} reads the variable {t.op.name!r} "
                                    f"other than by a ReadVariableOp")
            reads.append((index[t.op.name], op.outputs[0].name))
    return nodes, sorted(reads)


def _definition(graph, nodes: dict):
    """The GraphDef of ``nodes`` (and the graph's functions), without colocation attributes
    (which may name ops left out)."""
    full = graph.as_graph_def()
    out = v1.GraphDef()
    out.versions.CopyFrom(full.versions)
    out.library.CopyFrom(full.library)
    for node in full.node:
        if node.name in nodes:
            copy = out.node.add()
            copy.CopyFrom(node)
            copy.attr.pop("_class", None)
            kept = [i for i in copy.input if not i.startswith("^") or i[1:] in nodes]
            del copy.input[:]
            copy.input.extend(kept)
    return out


def _inputs(definition) -> set:
    """The tensors the nodes of ``definition`` take as inputs, each as "op:index"."""
    return {i if ":" in i else f"{i}:0" for node in definition.node for i in node.input
            if not i.startswith("^")}


def _gradients(positions: list, grads: list, trained: list, tapped: dict) -> list:
    """Each untapped trained variable's gradient: the sum of ``grads`` over its reads
    (``positions``: the variable each read is of); zeros where it has none."""
    per = {i: [] for i in range(len(trained)) if i not in tapped}
    for i, g in zip(positions, grads):
        if g is not None:
            per[i].append(tf.convert_to_tensor(g))
    return [tf.add_n(gs) if gs else tf.zeros(trained[i].shape, trained[i].dtype.base_dtype)
            for i, gs in per.items()]
