"""The TF1 face: a Trainer for a ``tf.compat.v1`` graph, bound per call to a session.

The trainer contract is :class:`~hostavg.train.trainer.BaseTrainer`'s; this face
wires the graph (:class:`~hostavg.tf1.wiring.Wiring`) once and binds it to the
session each call is given (:class:`~hostavg.tf1.session.SessionBackend`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import tensorflow as tf

from hostavg.core.check import CheckReport
from hostavg.core.errors import HostavgError, flag, positive_int
from hostavg.core.gradients import Gradients
from hostavg.core.results import Drop, MicroBatch, StepResult
from hostavg.core.split import feed_size
from hostavg.engine import step as engine
from hostavg.engine.protocols import AVERAGE_MODES
from hostavg.tf1.average import GraphAverage
from hostavg.tf1.feeds import resolve_feed
from hostavg.tf1.session import SESSION_THREADS, SessionBackend
from hostavg.tf1.wiring import Wiring
from hostavg.train.trainer import BaseTrainer, entries

v1 = tf.compat.v1

__all__ = ["AVERAGE_MODES", "Drop", "MicroBatch", "StepResult", "Trainer", "step_together"]


class Trainer(BaseTrainer):
    """Trains a ``tf.compat.v1`` graph with gradients averaged on the host.

    One optimizer step runs k micro-batches through forward and backward,
    fetching each one's gradients to NumPy; their sample-weighted mean
    ``sum_i n_i g_i / sum_i n_i`` (g_i: the gradient of micro-batch i's MEAN
    loss, n_i: its samples) is fed back through the gradient tensors to the
    optimizer's train op, which runs once. That equals one step on the
    concatenated batch, for any optimizer, and the global step grows by one.

    Build the trainer before ``global_variables_initializer()``: it creates the
    optimizer's slots and, if missing, the global step.

    Args:
      loss: scalar tensor, the MEAN of the per-sample losses of a micro-batch.
      optimizer: a ``tf.compat.v1.train.Optimizer``.
      var_list: the variables to train; default the trainable variables the
        loss reaches. Variables whose gradient is None are left out and untouched.
      average: one of :data:`AVERAGE_MODES`: "host" (NumPy) or "graph" (a
        small reduce graph in the session, fed the sums; TF1's face alone).
      global_step: the variable the train op increments (a scalar integer
        variable). Default: the graph's own (the GLOBAL_STEP collection, or a
        variable named "global_step" as TF1 programs make it), created if
        missing.
      increment_global_step: False for a trainer whose apply leaves the global
        step alone, such as the second of two trainers on one graph (a GAN's
        generator and discriminator): one step of the pair then counts once.
      update_ops: what each micro-batch runs beside forward and backward. None:
        the graph's UPDATE_OPS that the loss's own feeds can run (one that needs a
        placeholder the loss does not, such as the other network's batch norm
        in a GAN, is left out); a list: exactly those; ``[]``: none.
      accumulate, accum_dtype, hooks, comm, update_ratios_every, overlap: as
        for every trainer (:class:`~hostavg.train.trainer.BaseTrainer`; the
        hooks' protocol is :class:`~hostavg.core.results.Hook`). Measuring
        update ratios runs in the apply's own session call, at about the cost
        of the apply again (see the documentation's performance page).
      session_threads: one of :data:`~hostavg.tf1.session.SESSION_THREADS`: where the
        trainer's session calls run their ops. "pool" (default): in the
        session's inter-op thread pool, as ``sess.run`` does. "caller": in the
        calling thread, which saves TensorFlow's hand-off to the pool and back
        (50-100 us a call on 2 cores: a fifth of a small model's step), but
        keeps denormal floats that the pool's threads flush to zero (values
        below ~1.2e-38 in float32 may then differ from ``sess.run``'s); calls
        that reach a blocking kernel (:data:`~hostavg.tf1.session.BLOCKING_OPS`) use the pool
        anyway.

    Attributes:
      graph: the loss's graph; sessions passed in must run it.
      loss: the loss tensor.
      spec: name -> :class:`~hostavg.VariableSpec` of every trained variable.
      global_step: the global step variable.
      train_op: the optimizer's apply op, fed through the gradient tensors.
      update_ops: the ops each micro-batch runs (see the argument).
      apply_inputs: the placeholders the train op reads besides the gradients
        (a learning-rate placeholder), by name. ``step`` feeds each the value
        that every micro-batch of the step feeds it (a value that differs
        between micro-batches, or is missing, is an error before anything
        runs); ``apply`` takes them in ``feed_dict``.
      hooks: the hooks, in the order they run.
      rollback_variables: the variables a failed step restores: those that
        computing a micro-batch may assign (UPDATE_OPS' moving statistics,
        counters in the forward pass). Variables that are only read (weights,
        a frozen backbone) are not among them; when it is empty a step takes
        no snapshot at all.
      comm: the communicator, or None.

    Example::

        trainer = hostavg.Trainer(loss, v1.train.AdamOptimizer(1e-3))
        sess.run(v1.global_variables_initializer())
        res = trainer.step(sess, hostavg.split({x: xb, y: yb}, 32))
    """

    def __init__(self, loss, optimizer, var_list=None, *, accumulate: str = "sum",
                 average: str = "host", accum_dtype=None, global_step=None,
                 increment_global_step: bool = True, update_ops=None, hooks=(), comm=None,
                 update_ratios_every: int | None = None, session_threads: str = "pool",
                 overlap: bool = False):
        if not isinstance(loss, tf.Tensor) or not hasattr(loss, "graph"):
            raise HostavgError(
                f"loss must be a scalar tensor of a tf.compat.v1 graph, got {loss!r}; "
                f"build the model inside `with tf.Graph().as_default():`")
        if loss.shape.rank not in (None, 0):
            raise HostavgError(
                f"loss must be a scalar (the mean over the micro-batch's samples), got "
                f"shape {loss.shape}; reduce it with tf.reduce_mean")
        if not isinstance(optimizer, v1.train.Optimizer):
            raise HostavgError(
                f"optimizer must be a tf.compat.v1.train.Optimizer (e.g. "
                f"tf.compat.v1.train.AdamOptimizer), got {type(optimizer).__name__}")
        if average not in AVERAGE_MODES:
            raise HostavgError(f"average must be one of {AVERAGE_MODES}, got {average!r}")
        if session_threads not in SESSION_THREADS:
            raise HostavgError(
                f"session_threads must be one of {SESSION_THREADS}, got {session_threads!r}")
        if var_list is not None:
            var_list = _variables(var_list, loss.graph)
        if comm is not None and average == "graph":
            raise HostavgError("average='graph' cannot be combined with comm=: with several "
                               "processes the mean is the MPI reduction of the host sums")
        super().__init__(accumulate=accumulate, accum_dtype=accum_dtype, hooks=hooks, comm=comm,
                         update_ratios_every=update_ratios_every, overlap=overlap)
        self.average = average
        if average == "graph" and self.accum_dtype is not None:
            try:
                tf.as_dtype(self.accum_dtype)
            except TypeError:
                raise HostavgError(
                    f"accum_dtype {self.accum_dtype.name} has no TensorFlow dtype, and "
                    f"average='graph' sums in the session: pass float16, float32 or float64, or "
                    f"average='host'") from None
        self._wiring = Wiring(loss, optimizer, var_list, global_step,
                              accumulate=accumulate, average=average,
                              accum_dtype=self.accum_dtype, update_ops=update_ops,
                              increment_global_step=flag("increment_global_step", increment_global_step),
                              session_threads=session_threads)
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
        """A new, empty :class:`~hostavg.Accumulator` for this trainer's variables and settings.

        Args:
          sess: with ``average="graph"``, the session its mean() runs in
            (required there, ignored otherwise).
        """
        reducer = None
        if self.average == "graph":
            if sess is None:
                raise HostavgError("average='graph' computes the mean in a session: pass it, as "
                                   "trainer.accumulator(sess)")
            reducer = self._wiring.reducer.bind(self._backend(sess).session)
        return self._accumulator(reducer)

    def compute(self, sess, feed_dict: Mapping, *, size: int | None = None) -> Gradients:
        """Runs one micro-batch forward and backward and fetches its gradients.

        Also runs the graph's UPDATE_OPS (batch-norm moving statistics). Changes
        no trained variable and not the global step.

        Args:
          sess: a session running the trainer's graph.
          feed_dict: {placeholder, its name ("x:0") or its op's name ("x"): value}
            for one micro-batch.
          size: its number of samples; default the length of its arrays.

        Returns:
          :class:`Gradients` (read-only arrays) with ``.loss``, ``.size`` and
          ``.sq_norms`` (each gradient's squared norm, reduced in the session).
        """
        return self._compute(self._backend(sess), feed_dict, size)

    def apply(self, sess, grads: Mapping, feed_dict: Mapping | None = None) -> int:
        """Feeds ``grads`` through the gradient tensors and runs the train op once.

        No forward or backward pass runs. ``grads`` is a :class:`Gradients` or
        any mapping with exactly the keys of :attr:`spec` (say, a dict a user
        edited); values are cast to each variable's dtype, and copied unless
        hostavg made them (see :mod:`hostavg.core.gradients`). ``feed_dict`` feeds
        the placeholders the train op reads (:attr:`apply_inputs`, such as a
        learning rate); others in it are ignored.

        Returns:
          the global step after the apply (one more than before).

        Raises:
          HostavgError: for missing or extra keys, a wrong shape, a dtype that
            does not cast within its kind, non-finite values, or a placeholder
            the train op reads missing from ``feed_dict``; nothing is applied
            then.
        """
        backend = self._backend(sess)
        feed = backend.apply_feed([backend.conform(feed_dict or {}, "apply")], "apply")
        return self._apply(backend, grads, feed)

    def step(self, sess, feeds: Sequence[Mapping], sizes: Sequence[int] | None = None,
             rows: Sequence | None = None, *, fetches: Sequence | None = None) -> StepResult:
        """One optimizer step over the micro-batches ``feeds``: compute, add, apply.

        The step is atomic: if any micro-batch fails (bad feed, non-finite
        gradient or loss, an error in the session or in a hook) nothing is
        applied, and every variable that computing a micro-batch assigns
        (UPDATE_OPS' moving statistics) is restored, so the model, the
        optimizer's slots and the global step are as they were. See
        :mod:`hostavg.engine.step` for the order of things and the threading model.

        Args:
          sess: a session running the trainer's graph.
          feeds: a sequence of feed dicts, one per micro-batch, e.g.
            ``hostavg.split(feed_dict, micro_batch_size)``. With ``comm``,
            this rank's micro-batches (possibly none); the step's mean, loss,
            size and statistics are over every rank's, ``micro`` lists this
            rank's, and if any rank fails, every rank raises the same error
            naming it, with nothing applied anywhere.
          sizes: one number of samples per feed (its weight in the mean),
            where the arrays can't tell: feeds of scalars only, or arrays of
            different lengths. Default: the common length of each feed's arrays.
          rows: one array per feed of the row indices, in your data set, of
            its samples: kept as ``MicroBatch.rows`` and named in errors
            (``fit`` passes them). Default None.
          fetches: more tensors (or their names, or operations) to run in
            each micro-batch's own session call, as a program's
            ``sess.run([train_op, summary, accuracy], feed)`` ran them with its
            train op: each micro-batch's values, from before the step's
            update, are its ``MicroBatch.fetched`` (hooks see them) and
            ``res.fetched[i]``, in the order asked (None for an operation).

        Example::

            res = trainer.step(sess, hostavg.split(feed, 32), fetches=[accuracy])
            accuracy_now = np.average([a for a, in res.fetched],
                                      weights=[m.size for m in res.micro])
        """
        return self._step(self._backend(sess, fetches), feeds, sizes, rows)

    def check(self, sess, feed_dict: Mapping, micro_batch_size: int, *,
              blocks: Mapping | None = None) -> CheckReport:
        """Does this model's step over micro-batches equal its full-batch step? Changes nothing.

        Runs ``feed_dict`` whole (twice) and cut into micro-batches of
        ``micro_batch_size`` from the same weights, and compares the weighted
        mean of the micro-batch gradients with the whole feed's gradient, per
        variable. No apply runs, and what UPDATE_OPS moved is restored.

        Returns:
          a :class:`~hostavg.core.check.CheckReport`: ``.ok``, the largest relative
          difference per variable, and when not ok, the likely cause in words
          (a loss that is a sum rather than a mean, random ops such as dropout
          in training mode, batch norm in training mode). ``str(report)`` is
          a one-line verdict.

        Args:
          feed_dict: one batch, {placeholder: array}. For a graph that reads
            its batch from a tf.data iterator or a queue, feed the tensors it
            reads (the iterator's ``get_next()`` outputs): the check then
            takes nothing from the iterator.
          blocks: {placeholder: b} for arrays of b blocks of the samples, as
            :meth:`fit` takes it (see :func:`hostavg.split`).

        Raises:
          HostavgError: for a feed with no array of samples (only scalars, or
            empty), saying what check needs.

        Example::

            print(trainer.check(sess, {x: X[:256], y: Y[:256]}, 32))
        """
        feed = resolve_feed(self.graph, feed_dict, "check")
        return self._check(self._backend(sess), feed, micro_batch_size, self._blocks(blocks))

    def per_sample(self, sess, feed_dict: Mapping):
        """One row per sample of ``feed_dict``: its loss, gradient norm, and cosine with the feed's mean gradient.

        Which samples of a micro-batch pull against the rest (a mislabelled
        sample has a cosine near or below 0, often with a large norm), or
        which one holds the NaN. Changes nothing: no apply runs, and what
        UPDATE_OPS moved is restored.

        Cost: one forward and backward pass per sample (a session call each,
        so a feed of n samples costs about n times one micro-batch's
        overhead), and host memory for the n gradients at once. The mean is
        over the samples whose loss and gradient are finite; the others get
        a NaN cosine. With batch norm in training mode a sample alone is
        normalised by itself, so its gradient differs from its share of the
        batch's.

        Returns:
          a pandas DataFrame indexed by ``sample`` (position in the feed)
          with columns ``loss``, ``norm``, ``cosine``.

        Example::

            table = trainer.per_sample(sess, feeds[3])   # micro-batch 3, sample by sample
            table.sort_values("cosine").head()
        """
        return self._per_sample(self._backend(sess), feed_dict)

    def evaluate(self, sess, data: Mapping, *, batch_size: int, metrics: Mapping | None = None) -> dict:
        """The loss (and ``metrics``) over ``data``, sample-weighted, without training.

        Runs no gradient, no UPDATE_OPS, changes nothing.

        Args:
          data: {placeholder: array}, evaluated in chunks of ``batch_size`` samples.
          metrics: name -> scalar tensor, each the MEAN of a per-sample quantity
            over the chunk (e.g. accuracy), combined like the loss.

        Returns:
          {"loss": ..., **{name: ...}} as floats.
        """
        backend = self._backend(sess)
        metrics = self._metrics(metrics, "evaluate")
        return self._evaluate(backend, resolve_feed(self.graph, data, "evaluate"), batch_size,
                              metrics)

    def fit(self, sess, data, *, batch_size: int, micro_batch_size: int, epochs: int = 1,
            shuffle: bool = True, seed: int | None = None, drop_remainder: bool = False,
            validation_data: Mapping | None = None, metrics: Mapping | None = None,
            inputs=None, callbacks=(), progress=True, checkpoint_dir=None,
            checkpoint_every: int | None = None, keep_checkpoints: int = 3,
            blocks: Mapping | None = None, fetches: Sequence | None = None):
        """Trains over ``data`` for ``epochs``: batches of ``batch_size`` samples, each one step.

        Each batch is cut into micro-batches of ``micro_batch_size`` samples and
        applied as one optimizer step (:meth:`step`); a short last batch is
        weighted by its real sample count, or dropped with ``drop_remainder``.
        ``data`` is a dict ``{placeholder: array}``, an iterable of batch feed
        dicts (or a callable returning one per epoch), or a ``tf.data.Dataset``
        of single samples with ``inputs=`` naming the placeholder of each
        element key; see :mod:`hostavg.train.loop`.

        Args:
          shuffle, seed: a dict's samples are reordered each epoch by a
            permutation drawn from (seed, epoch): the same seed gives the same
            order on every run. None draws a seed (kept in checkpoints).
          validation_data: {placeholder: array}, evaluated at each epoch's end
            (:meth:`evaluate`, in chunks of micro_batch_size) into the epoch's
            "val_loss" and "val_<metric>" for each of ``metrics``; its keys,
            shapes and dtypes, and the metrics' shapes, are checked before
            the first epoch.
          callbacks: hooks for this fit only (:class:`~hostavg.core.results.Hook`):
            objects with any of the hook methods, step-level ones
            (``on_micro_batch``, ``on_step``, ``on_applied``) called in every
            step of this fit after the trainer's own hooks, fit-level ones
            (``on_epoch_end(epoch, logs)``, ``on_train_end(history)``,
            ``on_resume(step)``, ``close()``) as for the trainer's hooks;
            raising :class:`~hostavg.StopTraining` ends training cleanly.
          progress: True shows a tqdm bar on a terminal or in Jupyter,
            "always" shows it anywhere, "epoch" prints one line per epoch,
            "auto" shows the bar on a terminal or in Jupyter and prints the
            lines elsewhere, False shows nothing.
          checkpoint_dir: where to write checkpoints (:meth:`save`): of the
            start when it holds none, every ``checkpoint_every`` steps, at the
            end, and when an exception, KeyboardInterrupt or SIGTERM stops fit
            (at the last completed step); the newest ``keep_checkpoints`` are
            kept. If it already holds one, fit resumes from the newest:
            weights, optimizer, global step, position, seed and history, so an
            interrupted and resumed run ends with the weights of an
            uninterrupted one, bit for bit, unless the graph runs stateful
            random ops such as ``tf.nn.dropout``'s, whose state no checkpoint
            holds (fit warns: :class:`~hostavg.ResumeWarning`); resumed with
            another ``batch_size``, it continues at the sample where it stopped.
            A run that finished or was stopped by a callback does not train
            further.

          blocks: {placeholder: b} for arrays that hold b blocks of the
            samples one after another (the labels of a discriminator fed
            ``tf.concat([real, fake], 0)``: 2 N labels for N samples); every
            batch and micro-batch gets the matching rows of each block (see
            :func:`hostavg.split`).
          fetches: tensors every micro-batch runs too, as :meth:`step` takes
            them; hooks and callbacks see their values (``micro.fetched`` in
            ``on_micro_batch``, ``result.fetched`` in ``on_step`` and
            ``on_applied``).

        Each micro-batch knows the rows of ``data`` it holds (``MicroBatch.rows``;
        None for an iterable of feed dicts, whose rows fit can't tell). The
        trainer's hooks get the fit-level hook methods too.

        Returns:
          the :class:`~hostavg.History`.

        Raises:
          HostavgError: before training, for bad arguments, data that gives no
            batch, or a checkpoint_dir that is a file, cannot be written, or
            holds a damaged checkpoint or one of another model; during
            training, one whose message starts with where it happened (epoch,
            batch, global step) and names the micro-batch's data rows; any
            exception leaving fit carries ``.history``, the History up to it.
        """
        from hostavg.tf1.sources import feed_source
        backend = self._backend(sess, fetches)
        shuffle = flag("shuffle", shuffle)
        blocks = self._blocks(blocks)
        metrics = self._metrics(metrics, "fit")
        if validation_data is not None:  # its keys, shapes and dtypes, before an epoch trains
            feed_size(backend.conform(validation_data, "validation_data"), "validation_data")

        def validate(epoch):
            if validation_data is None:
                return {}
            return self.evaluate(sess, validation_data, batch_size=micro_batch_size,
                                 metrics=metrics)

        return self._fit(
            backend, lambda: feed_source(self.graph, data, inputs, batch_size, shuffle, blocks),
            validate, batch_size=batch_size, micro_batch_size=micro_batch_size, epochs=epochs,
            seed=seed, drop_remainder=drop_remainder, callbacks=callbacks, progress=progress,
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints, blocks=blocks)

    def _metrics(self, metrics, what: str) -> dict:
        """``metrics`` checked to map names other than "loss" to scalar tensors of the graph."""
        if metrics is not None and not isinstance(metrics, Mapping):
            raise HostavgError(f"{what}: metrics must be a dict name -> scalar tensor, got "
                               f"{type(metrics).__name__}")
        metrics = dict(metrics or {})
        if "loss" in metrics:
            raise HostavgError("metrics may not be named 'loss': that name holds the loss")
        for name, metric in metrics.items():
            if not isinstance(metric, tf.Tensor):
                raise HostavgError(f"{what}: metric {name!r} is {metric!r}, not a tensor of the "
                                   f"loss's graph; give a scalar tensor of it")
            if metric.graph is not self.graph:
                raise HostavgError(f"{what}: metric {name!r} is {metric.name!r}, a tensor of "
                                   f"another graph than the loss's; give a scalar tensor of the "
                                   f"loss's graph")
            if metric.shape.rank not in (None, 0):
                raise HostavgError(f"{what}: metric {name!r} has shape "
                                   f"{tuple(metric.shape.as_list())}, not a scalar; give the mean "
                                   f"over the batch")
        return metrics

    def save(self, sess, path) -> None:
        """Writes every variable of the graph (model, optimizer slots, global step) to ``path``.

        One ``.npz`` file written atomically; see :mod:`hostavg.train.checkpoint`.
        """
        self._save(self._backend(sess), path)

    def restore(self, sess, path) -> dict | None:
        """Loads a checkpoint written by :meth:`save` or :meth:`fit`; returns fit's state or None.

        Raises:
          HostavgError: if it was written by a different model; nothing changes then.
        """
        return self._restore(self._backend(sess), path)

    def _blocks(self, blocks: Mapping | None) -> dict:
        """``blocks`` keyed by the graph's tensors, each a number >= 1."""
        return {k: positive_int(f"blocks[{getattr(k, 'name', k)!r}]", b)
                for k, b in resolve_feed(self.graph, blocks or {}, "blocks").items()}

    def _backend(self, sess, fetches: Sequence | None = None) -> SessionBackend:
        return SessionBackend(self._wiring, sess, self._fetch_list(fetches))

    def _fetch_list(self, fetches: Sequence | None) -> tuple:
        """``fetches`` checked: a tuple of tensors and operations of the graph (names looked up)."""
        if fetches is None:
            return ()
        if not isinstance(fetches, (list, tuple)):
            got = getattr(fetches, "name", None)
            raise HostavgError(f"fetches must be a list or tuple of tensors or operations, got "
                               f"{repr(got) if got else type(fetches).__name__}; such as "
                               f"fetches=[accuracy, summary]")
        out = []
        for i, fetch in enumerate(fetches):
            what = f"fetches[{i}]"
            if isinstance(fetch, str):
                try:
                    fetch = self.graph.as_graph_element(fetch)
                except (KeyError, ValueError, TypeError) as e:
                    raise HostavgError(f"{what}: {fetch!r} names nothing in the trainer's graph "
                                       f"({e})") from None
            name = getattr(fetch, "name", None)
            if isinstance(fetch, tf.Variable):
                raise HostavgError(f"{what}: {name!r} is a variable; fetch a tensor that reads it "
                                   f"(made with the graph, such as tf.identity(v)), or read it "
                                   f"with sess.run after the step")
            if not isinstance(fetch, (tf.Tensor, tf.Operation)):
                raise HostavgError(f"{what}: {fetch!r} is not a tensor or an operation")
            if getattr(fetch, "graph", None) is not self.graph:
                raise HostavgError(f"{what}: {name or 'an eager tensor'!r} is not in the "
                                   f"trainer's graph; fetch tensors of the graph the loss was "
                                   f"built in")
            out.append(fetch)
        return tuple(out)

    def __repr__(self) -> str:
        return (f"Trainer(variables={len(self.spec)}, accumulate={self.accumulate!r}, "
                f"average={self.average!r}, accum_dtype={self.accum_dtype})")


def _variables(var_list, graph) -> list:
    """``var_list`` checked to be a list of distinct variables of ``graph``, as a list."""
    if isinstance(var_list, (tf.Variable, tf.Tensor, str, Mapping)) \
            or not isinstance(var_list, Iterable):
        what = f"the variable {var_list.op.name!r}" if isinstance(var_list, tf.Variable) \
            else repr(var_list)
        raise HostavgError(f"var_list must be a list of variables, got {what}; e.g. var_list=[w]")
    var_list, seen = list(var_list), set()
    if not var_list:
        raise HostavgError("var_list is empty: there is nothing to train")
    for v in var_list:
        if not isinstance(v, tf.Variable):
            what = f"the tensor {v.name!r}" if isinstance(v, tf.Tensor) else repr(v)
            raise HostavgError(f"var_list holds {what}, not a variable; list the variables to train")
        if v.graph is not graph:
            raise HostavgError(f"var_list holds variable {v.name!r} of another graph than the "
                               f"loss's; pass variables of the graph the loss was built in")
        if v.op.name in seen:
            raise HostavgError(f"var_list holds {v.op.name!r} twice; list each variable once")
        seen.add(v.op.name)
    return var_list


def step_together(sess, steps: Sequence[tuple]) -> list[StepResult]:
    """Steps several trainers of one graph from the same weights: all computed, then all applied.

    A GAN's simultaneous update: the discriminator's and the generator's
    gradients are both taken before either network changes, as a program's
    own ``sess.run([train_d, train_g])`` over gradients computed first.
    Atomic: if any micro-batch of any trainer fails, nothing is applied and
    every trainer's rollback variables are restored.

    Args:
      sess: the session running the trainers' graph.
      steps: ``(trainer, feeds)`` or ``(trainer, feeds, sizes)`` per trainer,
        as :meth:`Trainer.step` takes them; applied in this order.

    Returns:
      one :class:`StepResult` per trainer, in order.

    Example::

        d = hostavg.Trainer(d_loss, v1.train.AdamOptimizer(2e-4), var_list=d_vars)
        g = hostavg.Trainer(g_loss, v1.train.AdamOptimizer(2e-4), var_list=g_vars,
                            increment_global_step=False)
        res_d, res_g = hostavg.step_together(sess, [(d, feeds), (g, feeds)])
    """
    return engine.step_together([trainer._part(trainer._backend(sess), feeds, sizes)
                                 for trainer, feeds, sizes in entries(steps, Trainer,
                                                                      "step_together")])
