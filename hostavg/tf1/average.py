"""average="graph": the mean of a step's micro-batch gradients computed by a small graph in the trainer's session."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hostavg.core.accumulator import Reduction
from hostavg.core.dtypes import accumulation_dtype
from hostavg.engine.protocols import HostAverage
from hostavg.tf1.session import Callables

__all__ = ["GraphAverage", "GraphReducer"]

v1 = tf.compat.v1


class GraphAverage(HostAverage):
    """average="graph": the mean computed by the trainer's small averaging graph, in the step's session."""

    passes_one_through = False  # even of one micro-batch: (w g) / w in the session

    def __init__(self, wiring):
        self._reducer = wiring.reducer

    def reducer(self, backend, total: float):
        return self._reducer.bind(backend.session)


class GraphReducer:
    """average="graph": the mean of a :class:`Reduction`, computed by a small graph in the session.

    "sum" mode feeds each variable's running sum and scales it by
    ``scale / total`` in the graph; "stack" mode feeds the stacked micro-batch gradients
    (k, *shape) and their weights relative to the largest (w_i / scale) and reduces
    over axis 0 in the graph, then scales by ``scale / total``; sparse rows
    (weighted relative to the largest, as :class:`Reduction` holds them) are summed
    by ``unsorted_segment_sum`` and scaled alike. No factor exceeds 1, as on the
    host. The host only stacks, numbers the unique rows, feeds and fetches.
    """

    def __init__(self, spec, accum_dtype, accumulate, threads: str):
        self._dense_inputs, self._row_inputs, self._outputs = {}, {}, {}
        with tf.name_scope("hostavg_average"):
            self._weights = v1.placeholder(tf.float64, (None,), name="weights_over_scale")
            self._factor = v1.placeholder(tf.float64, (), name="scale_over_total")
            for name, s in spec.items():
                dtype = tf.as_dtype(accumulation_dtype(s.dtype, accum_dtype))
                factor = tf.cast(self._factor, dtype)
                if s.sparse:
                    ph = (v1.placeholder(tf.int64, (None,)), v1.placeholder(tf.int64, ()),
                          v1.placeholder(dtype, (None,) + s.shape[1:]),
                          v1.placeholder(dtype, (None,)))
                    segments, num_rows, values, row_weights = ph
                    weighted = values * tf.reshape(row_weights, [-1] + [1] * (len(s.shape) - 1))
                    self._outputs[name] = tf.math.unsorted_segment_sum(
                        weighted, segments, num_rows) * factor
                    self._row_inputs[name] = ph
                elif accumulate == "sum":
                    summed = self._dense_inputs[name] = v1.placeholder(dtype, s.shape)
                    self._outputs[name] = summed * factor
                else:
                    stack = self._dense_inputs[name] = v1.placeholder(dtype, (None,) + s.shape)
                    self._outputs[name] = tf.tensordot(
                        tf.cast(self._weights, dtype), stack, 1) * factor
        self._fetches = list(self._outputs.values())
        self._callables = Callables(threads)

    def bind(self, sess):
        """A reducer (Reduction -> name -> mean) that runs in ``sess``."""
        def reduce(r: Reduction) -> dict:
            feed = {self._weights: r.weights / r.scale, self._factor: r.scale / r.total}
            for name, s in r.sums.items():
                feed[self._dense_inputs[name]] = s
            for name, gs in r.stacks.items():
                feed[self._dense_inputs[name]] = np.stack(gs)
            uniques = {}
            for name, (indices, values, row_weights) in r.rows.items():
                uniques[name], segments = np.unique(indices, return_inverse=True)
                feed.update(zip(self._row_inputs[name],
                                (segments, len(uniques[name]), values, row_weights)))
            out = dict(zip(self._outputs,
                           self._callables.get(sess, self._fetches, tuple(feed))(*feed.values())))
            return {name: (uniques[name], value) if name in uniques else value
                    for name, value in out.items()}
        return reduce
