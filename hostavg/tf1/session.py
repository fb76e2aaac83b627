"""A TF1 trainer's session side: compiled session calls, and the engine's backend bound to one session.

:class:`SessionBackend` is the step engine's TF1 backend (a trainer's
:class:`~hostavg.tf1.wiring.Wiring` and a session); :class:`Callables` makes
and keeps the compiled calls every session call of hostavg goes through.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from hostavg.compat.tensorflow import first_line, session_call
from hostavg.core.errors import ArgumentError, HostavgError, StepError, positive_int, refused
from hostavg.core.split import blocks_of, feed_size
from hostavg.engine.protocols import Applied, ApplyRequest, Computed, SampleSums
from hostavg.tf1.denormals import like_the_pool
from hostavg.tf1.faster import Faster
from hostavg.tf1.feeds import brief, resolve_feed
from hostavg.tf1.variables import load_variables
from hostavg.tf1.walk import reaches

__all__ = ["BLOCKING_OPS", "SESSION_THREADS", "Callables", "SessionBackend"]

v1 = tf.compat.v1

#: Where a trainer's session calls run their ops. "pool": the session's inter-op thread
#: pool, as ``sess.run`` does. "caller": the thread that calls (TensorFlow's
#: ``RunOptions.inter_op_thread_pool = -1``): no hand-off to the pool and back, which can cost
#: as much as a small model's whole compute, but the ops of a call then run one after the
#: other. "auto" (the default): each session call is timed both ways on its first uses and
#: the faster kept (:class:`~hostavg.tf1.faster.Faster`). The calling thread flushes denormal
#: floats to zero and rounds to nearest during the call, as TensorFlow's pool threads do
#: (:mod:`hostavg.tf1.denormals`), so the values are the same either way; where that cannot
#: be done (not x86-64 Linux), "auto" keeps the pool and "caller"'s values below ~1.2e-38 in
#: float32 can differ from ``sess.run``'s in kernels small enough to run inline. A kernel that
#: blocks its thread until another op of the same call runs (a StagingArea's get before its
#: put) would wait forever, so calls that reach one of :data:`BLOCKING_OPS` use the pool
#: anyway. A graph placed on several devices (CPU and GPU) uses the pool either way.
SESSION_THREADS = ("auto", "pool", "caller")

#: Op types whose kernels block their thread until another op runs (StagingArea and
#: MapStagingArea gets, peeks and full puts): a call reaching one runs in the pool.
BLOCKING_OPS = frozenset({"Stage", "Unstage", "StagePeek", "MapStage", "MapUnstage",
                          "MapUnstageNoKey", "MapPeek", "OrderedMapStage", "OrderedMapUnstage",
                          "OrderedMapUnstageNoKey", "OrderedMapPeek"})


class SessionBackend:
    """A trainer's :class:`~hostavg.tf1.wiring.Wiring` bound to one session: the engine's TF1 backend.

    Session errors come out as :class:`HostavgError` saying what to do: an
    uninitialized variable asks for the initializer to be run after the
    Trainer is built; a feed the session refused points at the feed; any other
    failure is reported as the session's, with its first line.

    ``fetches``: tensors and operations (checked by the face) that every
    compute runs too, their values returned as ``Computed.fetched``.
    """

    nonfinite = "refuse"  # a TF1 optimizer applies whatever it is given

    def __init__(self, wiring, sess, fetches: tuple = ()):
        graph = getattr(sess, "graph", None)
        if graph is not wiring.graph:
            raise ArgumentError(
                f"the session runs another graph than the trainer's (got {sess!r}); "
                f"create it with tf.compat.v1.Session(graph=loss.graph)")
        self.wiring, self.session, self.fetches = wiring, sess, fetches
        self.spec = wiring.spec
        self.increment = wiring.increment

    @property
    def advice(self) -> dict:
        """:data:`~hostavg.tf1.advice.ADVICE`, naming the graph's training-mode switches
        (:attr:`Wiring.advice <hostavg.tf1.wiring.Wiring.advice>`)."""
        return self.wiring.advice

    @property
    def target(self):
        return self.session

    def conform(self, feed_dict, what: str) -> dict:
        """``feed_dict`` keyed by tensors, each value checked and converted (:attr:`Wiring.conform_feed`)."""
        return self.wiring.conform_feed(resolve_feed(self.wiring.graph, feed_dict, what), what)

    def prepare(self, feed_dict, size, what: str) -> tuple[dict, int]:
        feed = self.conform(feed_dict, what)
        for fetch in self.fetches:
            if fetch in feed:
                raise ArgumentError(f"{what}: {fetch.name!r} is fed and fetched; a tensor this "
                                    f"micro-batch feeds cannot be fetched (its value is the feed's)")
        unfed = self.wiring.unfed(tuple(feed), self.fetches)
        if unfed:
            names = ", ".join(repr(t.name) for t in unfed)
            raise ArgumentError(
                f"{what}: the graph reads placeholder{'s' if len(unfed) > 1 else ''} {names}, "
                f"which this feed does not give; feed {'them' if len(unfed) > 1 else 'it'} to "
                f"every micro-batch")
        if size is None:
            # Every value is an array now: one length along axis 0 is the size (feed_size
            # walks any structure, counts a micro-batch of split(..., blocks=) by its blocks,
            # and says what is wrong when the lengths differ).
            blocks = blocks_of(feed_dict)
            lengths = {len(a) for a in feed.values() if a.ndim}
            n = lengths.pop() if len(lengths) == 1 and not blocks else feed_size(
                feed, what, resolve_feed(self.wiring.graph, blocks, what))
            if n < 1:
                raise ArgumentError(f"{what}: a micro-batch must hold at least 1 sample, got {n}")
            return feed, n
        return feed, positive_int(f"{what}: size", size)

    def random_ops(self) -> tuple:
        return self.wiring.random_ops

    def compute(self, feed: dict, share: float = 1.0) -> Computed:
        """One micro-batch's session call (a TF1 optimizer scales no loss: ``share`` unused)."""
        with _session_errors("compute"):
            return self.wiring.compute(self.session, feed, self.fetches)

    @property
    def checks(self) -> bool:
        """Whether applies are checked (``check_applied``), for
        :class:`~hostavg.engine.protocols.Fused`."""
        return self.wiring.checks

    @property
    def fuses(self) -> bool:
        """Whether a step of one micro-batch can be one call
        (:class:`~hostavg.engine.protocols.Fused`): not with more ``fetches``, which the apply
        would have to wait for, nor where the mean is averaged in the graph."""
        return not self.fetches and self.wiring.fuses

    def compute_apply(self, feed: dict, allowance: float) -> tuple | None:
        """One micro-batch's session call that applies it too where its gate lets it
        (:class:`~hostavg.engine.protocols.Fused`)."""
        return self.wiring.compute_apply(self.session, feed, allowance)

    def sample_sums(self, feed: dict, dotted: bool = False) -> SampleSums:
        """See :class:`~hostavg.engine.protocols.Vectorized`: the loss's subgraph imported per
        sample under ``tf.vectorized_map`` (:mod:`hostavg.tf1.samples`), one session call;
        squared norms in float64, sums in the gradients' dtype; with ``dotted``, each
        gradient's dot with their sum in that call."""
        with _session_errors("per_sample"):
            out = self.wiring.samples(self.session, feed, "own" if dotted else "sums")
        losses, sq, *sums = out[:2 + len(self.spec)]
        return SampleSums(np.asarray(losses, np.float64), np.asarray(sq, np.float64),
                          dict(zip(self.spec, sums)),
                          np.asarray(out[-1], np.float64) if dotted else None)

    def sample_dots(self, feed: dict, mean) -> np.ndarray:
        """See :class:`~hostavg.engine.protocols.Vectorized`: g_i . ``mean``, in float64, each
        sample's gradient formed in the call and dotted there."""
        means = tuple(np.asarray(mean[name], np.float64) for name in self.spec)
        with _session_errors("per_sample"):
            return np.asarray(self.wiring.samples(self.session, feed, "dots", means)[0],
                              np.float64)

    def hvp(self, feed: dict, vector) -> tuple:
        with _session_errors("hvp"):
            return self.wiring.hvp(self.session, feed, vector)

    def apply_feed(self, feeds, what: str) -> dict:
        """The value every feed gives each of the train op's :attr:`~Wiring.apply_inputs`, by name.

        A placeholder with a default may go unfed (by every feed); any other
        must be fed the same value by each.
        """
        out = {}
        whose = "micro-batch" if what == "step" else "feed_dict"
        for name, key in self.wiring.apply_inputs.items():
            given = [f.get(key) for f in feeds]
            if all(v is None for v in given) and key.op.type == "PlaceholderWithDefault":
                continue
            first = given[0]
            for i, value in enumerate(given):
                if value is None:
                    raise ArgumentError(
                        f"{what}: the train op reads {name!r}, which {whose} {i} does not feed; "
                        + ("feed it, the same value, to every micro-batch" if what == "step" else
                           "pass it: trainer.apply(sess, grads, feed_dict={placeholder: value})"))
                if value is not first and not (value.shape == first.shape
                                               and np.array_equal(value, first)):
                    raise ArgumentError(
                        f"{what}: micro-batches 0 and {i} feed different values to {name!r} "
                        f"({brief(first)} and {brief(value)}), which the train op reads; the "
                        f"train op runs once per step, so feed every micro-batch the same value")
            out[name] = first
        return out

    def apply(self, mean, feed, request: ApplyRequest) -> Applied:
        with _session_errors("apply"):
            return self.wiring.apply(self.session, mean, feed, request)

    def global_step(self) -> int:
        return int(self.session.run(self.wiring.global_step))

    def evaluate(self, chunks, metrics=None) -> dict:
        """The loss and ``metrics`` (name -> scalar tensor, each a mean over its chunk) over
        ``chunks`` (feed dicts), sample-weighted; runs no gradient and no UPDATE_OPS."""
        fetches = {"loss": self.wiring.loss, **(metrics or {})}
        totals, count = dict.fromkeys(fetches, 0.0), 0
        for chunk in chunks:
            n = feed_size(chunk)
            with _session_errors("evaluate"):
                got = self.session.run(fetches, chunk)
            for name, value in got.items():
                if np.ndim(value) != 0:
                    raise StepError(f"evaluate: metric {name!r} has shape {np.shape(value)}, "
                                    f"not a scalar; give the mean over the batch")
                totals[name] += n * float(value)
            count += n
        return {name: total / count for name, total in totals.items()}

    def snapshot(self):
        with _session_errors("the snapshot of the rollback variables"):
            return self.wiring.snapshot(self.session)

    def restore(self, snapshot) -> None:
        self.wiring.restore(self.session, snapshot)

    def variables(self, names=None) -> dict:
        variables = self._globals(names)
        return dict(zip([v.op.name for v in variables], self.session.run(variables)))

    def weights(self) -> dict:
        return dict(zip(self.wiring.names, self.session.run(self.wiring.trained)))

    def assign(self, values) -> None:
        variables = self._globals(values)
        load_variables(self.session, variables, [values[v.op.name] for v in variables])

    def update_bound(self):
        """The optimizer's :class:`~hostavg.core.bounds.UpdateBound` (:mod:`hostavg.tf1.bounds`),
        or None: :class:`~hostavg.engine.protocols.Bounded`."""
        return self.wiring.update_bound

    def state_of(self, names) -> dict:
        """Each trained variable of ``names`` and its slots (the optimizer's ``get_slot``)."""
        return {name: (name, *(s.op.name for s in self.wiring.slots[name])) for name in names}

    def _globals(self, names=None) -> list:
        """The global variables, or those whose names are in ``names``."""
        variables = self.wiring.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
        if names is None:
            return variables
        names = set(names)
        return [v for v in variables if v.op.name in names]


class _session_errors:
    """Turns what a session call raises into a HostavgError saying what to do."""

    def __init__(self, call: str):
        self.call = call

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or isinstance(error, HostavgError) or not isinstance(error, Exception):
            return False
        said = f"{type(error).__name__}: {first_line(error)}"
        if isinstance(error, tf.errors.FailedPreconditionError) and "initializ" in str(error):
            raise StepError(
                f"a variable is not initialized ({said}); run "
                f"tf.compat.v1.global_variables_initializer() after building the Trainer, "
                f"which creates the optimizer's slots and the global step") from error
        if isinstance(error, (tf.errors.InvalidArgumentError, ValueError, TypeError,
                              OverflowError)):
            raise refused(f"the session refused the {self.call} ({said})",
                          "check that micro-batch's feed") from error
        if isinstance(error, (tf.errors.OpError, RuntimeError)):
            raise StepError(f"the session failed in {self.call} ({said})") from error
        return False


class Callables:
    """Compiled session calls, made once per (session, fetches, feed keys) and reused.

    ``sess.run`` parses its fetches and the feed dict in Python on every
    call, a large part of a small model's step (and public
    ``make_callable`` falls back to ``run`` whenever there are feeds). A
    callable made by :func:`hostavg.compat.tensorflow.session_call` skips
    that where TensorFlow's private ``_make_callable_from_options`` serves
    (else it is ``sess.run``, given the same RunOptions). Sessions are held
    weakly, so a dropped session takes its callables with it.

    ``threads`` (one of :data:`SESSION_THREADS`): "pool" hands each call's ops to
    the session's inter-op thread pool, as ``sess.run`` does; "caller" runs them
    in the calling thread (``RunOptions.inter_op_thread_pool = -1``), except in
    calls that reach one of :data:`BLOCKING_OPS`; "auto" compiles both and keeps
    the faster (:class:`~hostavg.tf1.faster.Faster`).
    """

    def __init__(self, threads: str = "auto"):
        self._by_session = weakref.WeakKeyDictionary()
        self.threads = threads

    def get(self, sess, fetches: list, feed_keys: tuple):
        """The callable for ``fetches`` (a flat list of tensors and operations) fed ``feed_keys``.

        It takes the feed values in that order and returns the tensors' values
        in order; operations are run, not returned.
        """
        made = self._by_session.get(sess)
        if made is None:  # (setdefault would make a weak reference on every call)
            made = self._by_session[sess] = {}
        key = (id(fetches), feed_keys)
        if key not in made:
            made[key] = _compile(sess, fetches, feed_keys, self.threads)
        return made[key]


def _compile(sess, fetches, feed_keys, threads: str):
    tensors = [f for f in fetches if isinstance(f, tf.Tensor)]
    targets = [f for f in fetches if isinstance(f, tf.Operation)]
    dtypes = [k.dtype.base_dtype.as_numpy_dtype for k in feed_keys]
    flushing = None
    if threads != "pool" and not reaches(fetches, feed_keys, BLOCKING_OPS):
        # the caller thread's ops then round as the pool's would; where that cannot be done,
        # "caller" runs them as they are (as documented) and "auto" keeps the pool
        flushing = like_the_pool() or (_as_it_is if threads == "caller" else None)
    if flushing is None:
        return _call(sess, tensors, targets, feed_keys, dtypes, None)
    caller = _call(sess, tensors, targets, feed_keys, dtypes, flushing)
    return caller if threads == "caller" else \
        Faster(_call(sess, tensors, targets, feed_keys, dtypes, None), caller)


def _as_it_is(run, *arrays):
    """``run(*arrays)`` in the running thread's own floating-point state."""
    return run(*arrays)


def _call(sess, tensors, targets, feed_keys, dtypes, flushing):
    """The compiled call in the pool (``flushing`` None), or in the calling thread run
    through ``flushing`` (:func:`~hostavg.tf1.denormals.like_the_pool`)."""
    options = None if flushing is None else v1.RunOptions(inter_op_thread_pool=-1)
    run, through = session_call(sess, tensors, targets, feed_keys, options), flushing or _as_it_is

    def call(*values):
        return through(run, *[np.asarray(v, d) for v, d in zip(values, dtypes)])
    return call
