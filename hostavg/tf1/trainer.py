"""The TF1 face: a Trainer for a ``tf.compat.v1`` graph, bound per call to a session.

The trainer contract is :class:`~hostavg.train.trainer.BaseTrainer`'s; this face
wires the graph (:class:`~hostavg.tf1.wiring.Wiring`) once and binds it to the
session each call is given (:class:`~hostavg.tf1.session.SessionBackend`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import tensorflow as tf

from hostavg.core.check import CheckReport
from hostavg.core.curvature import Curvature
from hostavg.core.errors import ArgumentError, flag, positive_int
from hostavg.core.gradients import Gradients
from hostavg.core.results import Drop, MicroBatch, StepResult
from hostavg.core.split import feed_size, split
from hostavg.engine import step as engine
from hostavg.engine.protocols import AVERAGE_MODES
from hostavg.tf1.average import GraphAverage
from hostavg.tf1.feeds import resolve_feed
from hostavg.tf1.saver import refuse_saver_checkpoint
from hostavg.tf1.session import SESSION_THREADS, SessionBackend
from hostavg.tf1.wiring import Wiring
from hostavg.train.history import History
from hostavg.train.sources import Validation
from hostavg.train.trainer import (DEFAULT_BATCH_SIZE, BaseTrainer, micro_batch_size_third,
                                   together_entries)

v1 = tf.compat.v1

#: The op types that make a variable (a resource handle, a reference).
VARIABLE_OPS = ("VarHandleOp", "VariableV2", "Variable")

__all__ = ["AVERAGE_MODES", "Drop", "MicroBatch", "StepResult", "Trainer", "step_together"]


class Trainer(BaseTrainer):
    """Trains a ``tf.compat.v1`` graph with gradients averaged on the host.

    The trainer contract is :class:`~hostavg.train.trainer.BaseTrainer`'s:
    the same methods, arguments and results as ``hostavg.keras.Trainer``. The
    optimizer's train op runs once per step, fed the mean through the
    gradient tensors; the global step grows by one. Build the trainer before
    ``global_variables_initializer()``: it makes the optimizer's slots and,
    if missing, the global step.

    What this face adds, because a TF1 graph needs it:

    - every method takes the session first: a graph's values live in the
      session each call is given, not in the trainer;
    - data is feed dicts ``{placeholder, its name or its op's name: array}``:
      ``step(sess, feeds)`` a list of them, ``fit(sess, data)`` one of N
      samples, an iterable of batches or a ``tf.data.Dataset`` with ``inputs=``
      (element key or position -> placeholder);
    - ``apply(sess, grads, feed_dict)``: the placeholders the train op reads;
    - ``step``/``fit`` ``fetches=``: what each micro-batch's call reads too
      (summaries, metrics; no train op), as ``MicroBatch.fetched``;
    - ``check``/``fit`` ``blocks=``: {placeholder: b} for arrays of b blocks
      of the samples (a discriminator's real and fake labels);
    - ``evaluate``/``fit`` ``metrics=``: name -> scalar tensor, each the mean
      of a per-sample quantity, a graph having no compiled metrics.

    Example::

        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(1e-3), micro_batch_size=32)
        sess.run(v1.global_variables_initializer())
        res = trainer.step(sess, hostavg.split({x: xb, y: yb}, 32))
    """

    def __init__(self, loss, optimizer, var_list=None, *, micro_batch_size: int | None = None,
                 micro_batches: int | None = None, accumulate: str = "sum", average: str = "host",
                 accum_dtype=None, global_step=None, increment_global_step: bool = True,
                 update_ops=None, hooks=(), comm=None, update_ratios_every: int | None = None,
                 session_threads: str = "auto", overlap: bool = False,
                 distributions_every: int | None = None, check_applied: bool = True,
                 statistics=None, watch_outliers: bool = True, diagnose: bool = True):
        """Wires the graph: gradient tensors, the fed train op, the host's fetches.

        The keywords every face takes are :class:`~hostavg.train.trainer.BaseTrainer`'s
        (``micro_batch_size``, ``accumulate``, ``hooks``, ...).

        Args:
          loss: scalar tensor, the MEAN of the per-sample losses of a micro-batch.
          optimizer: a ``tf.compat.v1.train.Optimizer``.
          var_list: the variables to train; default the trainable variables the
            loss reaches. Variables whose gradient is None are left out.
          average: one of :data:`AVERAGE_MODES`: "host" (NumPy) or "graph" (a
            small reduce graph in the session, fed the sums; this face's alone).
          global_step: the scalar integer variable the train op increments;
            default the graph's own (GLOBAL_STEP, or "global_step"), made if missing.
          increment_global_step: False for a trainer whose apply leaves the
            global step alone (the second of a GAN's two trainers).
          update_ops: what each micro-batch runs beside forward and backward.
            None: the graph's UPDATE_OPS that the loss's feeds can run; a
            list: exactly those; ``[]``: none.
          session_threads: one of :data:`~hostavg.tf1.session.SESSION_THREADS`:
            "pool" runs the trainer's session calls in the session's
            inter-op pool, as ``sess.run``; "caller" in the calling thread
            (faster for small models; it flushes denormal floats to zero
            during the call as the pool does, on x86-64 Linux); "auto"
            (default) times each call both ways on its first uses and keeps
            the faster, the same values either way. See the performance page.

        Attributes:
          graph: the loss's graph; sessions passed in must run it.
          loss: the loss tensor.
          average: as given.
          global_step: the global step variable.
          train_op: the optimizer's apply op, fed through the gradient tensors.
          update_ops: the ops each micro-batch runs.
          apply_inputs: the placeholders the train op reads besides the
            gradients, by name: ``step`` feeds each the value all its
            micro-batches feed it; ``apply`` takes them in ``feed_dict``.
          rollback_variables: what a failed step restores (UPDATE_OPS' moving
            statistics, counters the forward pass assigns); empty: no snapshot.
        """
        if not isinstance(loss, tf.Tensor) or not hasattr(loss, "graph"):
            raise ArgumentError(
                f"loss must be a scalar tensor of a tf.compat.v1 graph, got {loss!r}; "
                f"build the model inside `with tf.Graph().as_default():`")
        if loss.shape.rank not in (None, 0):
            raise ArgumentError(
                f"loss must be a scalar (the mean over the micro-batch's samples), got "
                f"shape {loss.shape}; reduce it with tf.reduce_mean")
        if not isinstance(optimizer, v1.train.Optimizer):
            raise ArgumentError(
                f"optimizer must be a tf.compat.v1.train.Optimizer (e.g. "
                f"tf.compat.v1.train.AdamOptimizer), got {type(optimizer).__name__}")
        if average not in AVERAGE_MODES:
            raise ArgumentError(f"average must be one of {AVERAGE_MODES}, got {average!r}")
        if session_threads not in SESSION_THREADS:
            raise ArgumentError(
                f"session_threads must be one of {SESSION_THREADS}, got {session_threads!r}")
        if var_list is not None:
            var_list = _variables(var_list, loss.graph)
        if comm is not None and average == "graph":
            raise ArgumentError("average='graph' cannot be combined with comm=: with several "
                                "processes the mean is the MPI reduction of the host sums")
        super().__init__(micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                         accumulate=accumulate, accum_dtype=accum_dtype, hooks=hooks, comm=comm,
                         update_ratios_every=update_ratios_every, overlap=overlap,
                         distributions_every=distributions_every,
                         check_applied=check_applied, statistics=statistics,
                         watch_outliers=watch_outliers, diagnose=diagnose)
        self.average = average
        if average == "graph" and self.accum_dtype is not None:
            try:
                tf.as_dtype(self.accum_dtype)
            except TypeError:
                raise ArgumentError(
                    f"accum_dtype {self.accum_dtype.name} has no TensorFlow dtype, and "
                    f"average='graph' sums in the session: pass float16, float32 or float64, or "
                    f"average='host'") from None
        self._wiring = Wiring(loss, optimizer, var_list, global_step,
                              accumulate=accumulate, average=average,
                              accum_dtype=self.accum_dtype, update_ops=update_ops,
                              increment_global_step=flag("increment_global_step", increment_global_step),
                              session_threads=session_threads,
                              check_applied=self.check_applied)
        self.graph = self._wiring.graph
        self.loss = loss
        self.global_step = self._wiring.global_step
        self.train_op = self._wiring.train_op
        self.update_ops = tuple(self._wiring.update_ops)
        self.apply_inputs = dict(self._wiring.apply_inputs)
        self.rollback_variables = tuple(self._wiring.assigned)
        if comm is None and average == "graph":
            self._average = GraphAverage(self._wiring)
        self._make_engine(self._wiring.spec)

    def accumulator(self, sess=None):
        reducer = None
        if self.average == "graph":
            if sess is None:
                raise ArgumentError("average='graph' computes the mean in a session: pass it, as "
                                    "trainer.accumulator(sess)")
            reducer = self._wiring.reducer.bind(self._bind(sess).session)
        return self._accumulator(reducer)

    def compute(self, sess, feed_dict: Mapping, *, size: int | None = None) -> Gradients:
        return self._compute(self._bind(sess), feed_dict, size)

    def apply(self, sess, grads: Mapping, feed_dict: Mapping | None = None) -> int:
        backend = self._bind(sess)
        feed = backend.apply_feed([backend.conform(feed_dict or {}, "apply")], "apply")
        return self._apply(backend, grads, feed)

    def step(self, sess, feeds: Sequence[Mapping], sizes: Sequence[int] | None = None,
             rows: Sequence | None = None, *, fetches: Sequence | None = None) -> StepResult:
        return self._step(self._bind(sess, fetches), feeds, sizes, rows)

    @micro_batch_size_third("sess, feed_dict")
    def check(self, sess, feed_dict: Mapping, *, micro_batch_size: int | None = None,
              blocks: Mapping | None = None) -> CheckReport:
        feed = resolve_feed(self.graph, feed_dict, "check")
        return self._check(self._bind(sess), feed, micro_batch_size, self._blocks(blocks))

    def per_sample(self, sess, feed_dict: Mapping, *, rows=None, chunk_size=None):
        return self._per_sample(self._bind(sess), feed_dict, rows, chunk_size)

    def hvp(self, sess, feed_dict: Mapping, *, vectors: Mapping,
            micro_batch_size: int | None = None) -> Gradients:
        feed = resolve_feed(self.graph, feed_dict, "hvp")
        return self._hvp(self._bind(sess), feed, vectors, micro_batch_size)

    def curvature(self, sess, feed_dict: Mapping, *, trace_samples: int = 16, top: int = 1,
                  iterations: int = 20, tolerance: float = 1e-3, seed: int = 0,
                  micro_batch_size: int | None = None) -> Curvature:
        feed = resolve_feed(self.graph, feed_dict, "curvature")
        return self._curvature(self._bind(sess), feed, dict(
            trace_samples=trace_samples, top=top, iterations=iterations, tolerance=tolerance,
            seed=seed), micro_batch_size)

    def evaluate(self, sess, data: Mapping, *, batch_size: int | None = None,
                 metrics: Mapping | None = None) -> dict:
        backend = self._bind(sess)
        metrics = self._metrics(metrics, "evaluate")
        feed = resolve_feed(self.graph, data, "evaluate")
        size = DEFAULT_BATCH_SIZE if batch_size is None else positive_int("batch_size", batch_size)
        return self._evaluate(backend, split(feed, size), metrics)

    def fit(self, sess, data, *, batch_size: int | None = None,
            micro_batch_size: int | None = None, epochs: int = 1, verbose="auto", callbacks=None,
            validation_data: Mapping | None = None, validation_freq=1, shuffle: bool = True,
            initial_epoch: int = 0, steps_per_epoch: int | None = None, seed: int | None = None,
            drop_remainder: bool = False, progress=None, checkpoint_dir=None,
            checkpoint_every: int | None = None, keep_checkpoints: int = 3,
            metrics: Mapping | None = None, inputs=None, blocks: Mapping | None = None,
            fetches: Sequence | None = None) -> History:
        from hostavg.tf1.sources import feed_source
        backend = self._bind(sess, fetches)
        shuffle = flag("shuffle", shuffle)
        blocks = self._blocks(blocks)
        metrics = self._metrics(metrics, "fit")
        if batch_size is None and isinstance(data, (Mapping, tf.data.Dataset)):  # of samples
            batch_size = DEFAULT_BATCH_SIZE
        if validation_data is not None:  # its keys, shapes and dtypes, before an epoch trains
            validation_data = backend.conform(validation_data, "validation_data")
            feed_size(validation_data, "validation_data")
        arguments = self._fit_arguments(
            batch_size=batch_size, micro_batch_size=micro_batch_size, epochs=epochs,
            verbose=verbose, progress=progress, validation_freq=validation_freq, seed=seed,
            drop_remainder=drop_remainder, callbacks=callbacks, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints, blocks=blocks,
            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch)
        source = feed_source(self.graph, data, inputs, batch_size, shuffle, blocks)
        validation = None if validation_data is None else Validation(
            split(validation_data, arguments.cut.largest(batch_size or DEFAULT_BATCH_SIZE)),
            arguments.validation_freq, metrics)
        return self._fit(backend, source, validation, arguments)

    def save(self, sess, path) -> None:
        self._save(self._bind(sess), path)

    def restore(self, sess, path) -> dict | None:
        backend = self._bind(sess)
        refuse_saver_checkpoint(path)
        return self._restore(backend, path)

    def _metrics(self, metrics, what: str) -> dict:
        """``metrics`` checked to map names other than "loss" to scalar tensors of the graph."""
        if metrics is not None and not isinstance(metrics, Mapping):
            raise ArgumentError(f"{what}: metrics must be a dict name -> scalar tensor, got "
                                f"{type(metrics).__name__}")
        metrics = dict(metrics or {})
        if "loss" in metrics:
            raise ArgumentError("metrics may not be named 'loss': that name holds the loss")
        for name, metric in metrics.items():
            if not isinstance(metric, tf.Tensor):
                raise ArgumentError(f"{what}: metric {name!r} is {metric!r}, not a tensor of the "
                                    f"loss's graph; give a scalar tensor of it")
            if metric.graph is not self.graph:
                raise ArgumentError(f"{what}: metric {name!r} is {metric.name!r}, a tensor of "
                                    f"another graph than the loss's; give a scalar tensor of the "
                                    f"loss's graph")
            if metric.shape.rank not in (None, 0):
                raise ArgumentError(f"{what}: metric {name!r} has shape "
                                    f"{tuple(metric.shape.as_list())}, not a scalar; give the mean "
                                    f"over the batch")
        return metrics

    def _blocks(self, blocks: Mapping | None) -> dict:
        """``blocks`` keyed by the graph's tensors, each a number >= 1."""
        return {k: positive_int(f"blocks[{getattr(k, 'name', k)!r}]", b)
                for k, b in resolve_feed(self.graph, blocks or {}, "blocks").items()}

    def _bind(self, sess, fetches: Sequence | None = None) -> SessionBackend:
        """The backend of this trainer's wiring in ``sess``, running ``fetches`` too."""
        return SessionBackend(self._wiring, sess, self._fetch_list(fetches))

    def _fetch_list(self, fetches: Sequence | None) -> tuple:
        """``fetches`` checked: a tuple of tensors and operations of the graph (names looked up)."""
        if fetches is None:
            return ()
        if not isinstance(fetches, (list, tuple)):
            got = getattr(fetches, "name", None)
            raise ArgumentError(f"fetches must be a list or tuple of tensors or operations, got "
                                f"{repr(got) if got else type(fetches).__name__}; such as "
                                f"fetches=[accuracy, summary]")
        out = []
        for i, fetch in enumerate(fetches):
            what = f"fetches[{i}]"
            if isinstance(fetch, str):
                try:
                    fetch = self.graph.as_graph_element(fetch)
                except (KeyError, ValueError, TypeError) as e:
                    raise ArgumentError(f"{what}: {fetch!r} names nothing in the trainer's graph "
                                        f"({e})") from None
            if isinstance(fetch, tf.Variable) and fetch.op.type not in VARIABLE_OPS:
                fetch = fetch.op  # what a resource variable's assign returns: its op
            name = getattr(fetch, "name", None)
            if isinstance(fetch, tf.Variable):
                raise ArgumentError(f"{what}: {name!r} is a variable; fetch a tensor that reads it "
                                    f"(made with the graph, such as tf.identity(v)), or read it "
                                    f"with sess.run after the step")
            if not isinstance(fetch, (tf.Tensor, tf.Operation)):
                raise ArgumentError(f"{what}: {fetch!r} is not a tensor or an operation")
            if getattr(fetch, "graph", None) is not self.graph:
                raise ArgumentError(f"{what}: {name or 'an eager tensor'!r} is not in the "
                                    f"trainer's graph; fetch tensors of the graph the loss was "
                                    f"built in")
            change = self._wiring.changes(fetch)
            if change is not None:
                raise ArgumentError(
                    f"{what}: {name!r} runs {change[0].name!r} ({change[0].type}), which "
                    f"{change[1]}: fetched, it would run with every micro-batch. hostavg applies "
                    f"the step's update itself, once per step; fetch what reads the graph "
                    f"(summaries, metrics, activations), not what changes it")
            out.append(fetch)
        return tuple(out)

    def _face(self) -> dict:
        return {"face": "hostavg.Trainer", "average": self.average}


def _variables(var_list, graph) -> list:
    """``var_list`` checked to be a list of distinct variables of ``graph``, as a list."""
    if isinstance(var_list, (tf.Variable, tf.Tensor, str, Mapping)) \
            or not isinstance(var_list, Iterable):
        what = f"the variable {var_list.op.name!r}" if isinstance(var_list, tf.Variable) \
            else repr(var_list)
        raise ArgumentError(f"var_list must be a list of variables, got {what}; e.g. var_list=[w]")
    var_list, seen = list(var_list), set()
    if not var_list:
        raise ArgumentError("var_list is empty: there is nothing to train")
    for v in var_list:
        if not isinstance(v, tf.Variable):
            what = f"the tensor {v.name!r}" if isinstance(v, tf.Tensor) else repr(v)
            raise ArgumentError(f"var_list holds {what}, not a variable; list the variables to train")
        if v.graph is not graph:
            raise ArgumentError(f"var_list holds variable {v.name!r} of another graph than the "
                                f"loss's; pass variables of the graph the loss was built in")
        if v.op.name in seen:
            raise ArgumentError(f"var_list holds {v.op.name!r} twice; list each variable once")
        seen.add(v.op.name)
    return var_list


def step_together(sess, steps: Sequence[tuple]) -> list[StepResult]:
    """Steps several trainers of one graph from the same weights: all computed, then all applied.

    A GAN's simultaneous update: the discriminator's and the generator's
    gradients are both taken before either network changes, as a program's
    own ``sess.run([train_d, train_g])`` over gradients computed first.
    Atomic: if any micro-batch of any trainer fails, nothing is applied and
    every trainer's rollback variables are restored.
    The first apply found non-finite has every step tried again without the
    micro-batches that drove it where a hook drops them (``SkipNonFinite``);
    a later one raises, saying which applies stay (docs/explanation/errors.md).

    Args:
      sess: the session running the trainers' graph.
      steps: ``(trainer, feeds)`` or ``(trainer, feeds, sizes)`` per trainer,
        as :meth:`Trainer.step` takes them; applied in this order.

    Returns:
      one :class:`StepResult` per trainer, in order (``[]`` for ``[]``).

    Example::

        d = hostavg.Trainer(d_loss, v1.train.AdamOptimizer(2e-4), var_list=d_vars)
        g = hostavg.Trainer(g_loss, v1.train.AdamOptimizer(2e-4), var_list=g_vars,
                            increment_global_step=False)
        res_d, res_g = hostavg.step_together(sess, [(d, feeds), (g, feeds)])
    """
    return engine.step_together([trainer._together_entry(trainer._bind(sess), feeds, sizes)
                                 for trainer, feeds, sizes in together_entries(steps, Trainer,
                                                                               "step_together")])
