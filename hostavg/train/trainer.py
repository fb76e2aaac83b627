"""The one trainer contract: every public trainer method declared once, over the engine.

``hostavg.Trainer`` (a TF1 graph and its session) and ``hostavg.keras.Trainer``
(a Keras 3 model) subclass :class:`BaseTrainer`. Each public method is declared
here once, with its one docstring; a face overrides it only to take data in
its framework's form (the TF1 face a session first and feed dicts, the Keras
face ``x, y, sample_weight`` as ``train_on_batch``) and calls the shared
implementation below it. The architecture page of the documentation draws the
call path: face -> :class:`BaseTrainer` -> :class:`~hostavg.engine.step.Engine`
-> :class:`~hostavg.engine.protocols.Backend`.

Framework-free: nothing here imports TensorFlow, Keras or JAX.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import warnings
from collections.abc import Mapping, Sequence

from hostavg.core.accumulator import ACCUMULATE_MODES, Accumulator, as_accum_dtype
from hostavg.core import display
from hostavg.core.check import CheckReport
from hostavg.core.curvature import Curvature, CurvatureSettings
from hostavg.core.errors import ArgumentError, flag, positive_int
from hostavg.core.gradients import Gradients
from hostavg.core.optional import pandas
from hostavg.core.results import StepResult
from hostavg.core.schema import UserStatistics
from hostavg.core.split import Cut, cut, pieces, sample_count, split, take
from hostavg.engine.hooks import normalize_hooks
from hostavg.engine.protocols import Backend, HostAverage
from hostavg.engine.step import Engine
from hostavg.train import checkpoint
from hostavg.train.history import History
from hostavg.train.diagnose import Diagnose
from hostavg.train.hooks import WatchOutliers
from hostavg.train.loop import FitArguments, fit_arguments
from hostavg.train.loop import fit as fit_loop
from hostavg.train.progress import VERBOSE, checked_verbose
from hostavg.train.sources import BatchSource, Validation, checked_validation_freq

__all__ = ["BaseTrainer", "TrainerRun", "deprecated_form", "is_integer", "micro_batch_size_third",
           "together_entries"]

#: What fit cuts a batch of samples into when no batch size is given: Keras's default.
DEFAULT_BATCH_SIZE = 32
#: The settings a trainer's one-line repr shows (its HTML table shows them all).
_REPR = ("model", "variables", "micro_batch_size", "micro_batches", "accumulate", "average",
         "accum_dtype", "batch_norm", "hooks")


def deprecated_form(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns (``DeprecationWarning``) that ``old``, a call form of the last release that still
    works in this one, goes in the next, naming ``new``; ``stacklevel``: one more than the
    frames between this function and the caller's call."""
    warnings.warn(f"{old} is deprecated since hostavg 0.2.0 and will be removed in 0.3.0; "
                  f"write {new}", DeprecationWarning, stacklevel=stacklevel)


def is_integer(value) -> bool:
    """Whether ``value`` is an integer of any kind, Python's or NumPy's (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def micro_batch_size_third(given: str):
    """Makes a face's ``check`` also take an integer micro_batch_size third, after the two
    arguments ``given`` names (such as "x, y"), as 0.1.0's ``check(x, y, 32)`` did, with a
    DeprecationWarning naming the keyword; its signature (``inspect.signature``) stays the
    keyword one."""
    def wrap(check):
        @functools.wraps(check)
        def checked(self, *args, **kwargs):
            if len(args) == 3 and is_integer(args[2]) and "micro_batch_size" not in kwargs:
                size = int(args[2])
                deprecated_form(f"check({given}, {size})",
                                f"check({given}, micro_batch_size={size})")
                args, kwargs = args[:2], {**kwargs, "micro_batch_size": args[2]}
            return check(self, *args, **kwargs)
        return checked
    return wrap


class BaseTrainer:
    """What every trainer face shares: the engine, its settings, and each public method.

    A step computes k micro-batches' gradients on the host and applies their
    sample-weighted mean once, ``g = sum_i n_i g_i / sum_i n_i`` (g_i of
    micro-batch i's MEAN loss, n_i its samples): the full-batch step.

    Attributes:
      micro_batch_size: as given; so are the other settings but accum_dtype.
      accum_dtype: as a NumPy dtype, or None.
      hooks: a tuple, in the order they run.
      spec: name -> :class:`~hostavg.VariableSpec` of every trained variable.
      rollback_variables: what a failed step restores: the variables that
        computing a micro-batch assigns (moving statistics, counters).
    """

    def __init__(self, *, micro_batch_size: int | None = None, micro_batches: int | None = None,
                 accumulate: str = "sum", accum_dtype=None, hooks=(), comm=None,
                 update_ratios_every: int | None = None, overlap: bool = False,
                 distributions_every: int | None = None, check_applied: bool = True,
                 statistics=None, watch_outliers: bool = True, diagnose: bool = True):
        """The settings every face takes, by keyword.

        Args:
          micro_batch_size: samples per micro-batch, for :meth:`fit` (and its
            validation) and :meth:`check` where not given their own.
          micro_batches: or instead, how many micro-batches (k) a batch is cut
            into: k of sizes differing by at most one, as :func:`hostavg.split`
            cuts them (64 samples in 3: 22, 21, 21); with ``comm``, each
            process's share. Both given is an error; neither: fit and check need one.
          accumulate: one of :data:`~hostavg.ACCUMULATE_MODES`: "sum" keeps a
            running sum (one gradient's memory), "stack" every micro-batch's
            gradients (``StepResult.micro[i].grads`` and the statistics needing them).
          accum_dtype: the host accumulation dtype ("float64"); None: each variable's.
          hooks: objects with any of the hook methods of :class:`~hostavg.core.results.Hook`.
          comm: an mpi4py communicator to train over several processes; None: this one.
          update_ratios_every: measure ``StepResult.update_ratios`` (|w_after -
            w_before| / |w_before|) every that many global steps; None: only where a hook
            asks (the default Diagnose: the first 20 applies, then one in 10).
          overlap: compute micro-batch i + 1 in a worker thread while the host
            handles micro-batch i; the same results bit for bit.
          distributions_every: keep ``StepResult.distributions`` (percentiles of each
            variable's gradient, weights, update) every that many global steps; None: never.
          check_applied: check the updated weights and optimizer state for NaN and Inf in
            each apply's call, undoing a non-finite update; False: don't (cost: performance page).
          statistics: ``{name: fn}``, each ``fn(result)`` of the step's StepResult (after the
            mean, before the apply) a number, k numbers (per micro-batch) or ``{variable:
            number}``, kept as ``StepResult.statistics[name]`` and shown wherever a step is
            (History, Record, TensorBoard, plots); see docs/guides/inspecting.md.
          watch_outliers: run a :class:`~hostavg.hooks.WatchOutliers` (warn) after ``hooks``;
            False: don't.
          diagnose: run a :class:`~hostavg.hooks.Diagnose` last (its verdicts reach History;
            pass one in ``hooks`` before a Record to have it see them); False: don't.
        """
        if accumulate not in ACCUMULATE_MODES:
            raise ArgumentError(f"accumulate must be one of {ACCUMULATE_MODES}, got {accumulate!r}")
        self._cut = cut(micro_batch_size, micro_batches)
        self.accumulate = accumulate
        self.accum_dtype = as_accum_dtype(accum_dtype)
        self.hooks = normalize_hooks(hooks) + (
            (WatchOutliers(),) if flag("watch_outliers", watch_outliers) else ()) + (
            (Diagnose(),) if flag("diagnose", diagnose) else ())
        self.update_ratios_every = None if update_ratios_every is None else positive_int(
            "update_ratios_every", update_ratios_every)
        self.overlap = flag("overlap", overlap)
        self.distributions_every = None if distributions_every is None else positive_int(
            "distributions_every", distributions_every)
        self.check_applied = flag("check_applied", check_applied)
        self.statistics = UserStatistics(statistics)
        self.comm = comm
        if comm is not None:
            from hostavg.engine.mpi import Distributed  # mpi4py is imported on use only
            self._average = Distributed(comm)
        else:
            self._average = HostAverage()
        self._engine: Engine | None = None

    # --- The public methods, declared once: each face takes its data and calls the part below.

    def accumulator(self) -> Accumulator:
        """A new, empty :class:`~hostavg.Accumulator` for this trainer's variables and settings.

        The TF1 face takes a session first, which ``average="graph"`` needs
        (its ``mean()`` runs there).
        """
        raise NotImplementedError

    def compute(self, batch, *, size: int | None = None) -> Gradients:
        """Runs one micro-batch forward and backward; returns its gradients on the host.

        Changes no trained variable and not the step counter; what the forward
        pass assigns in training (batch-norm moving statistics) moves, as in a
        training step.

        Args:
          batch: one micro-batch, as the face takes it: TF1 ``sess, feed_dict``
            ({placeholder, its name or its op's name: array}); Keras
            ``x, y=None, sample_weight=None``, as ``model.train_on_batch``.
          size: its number of samples (its weight in a mean); default the
            length of its arrays.

        Returns:
          :class:`~hostavg.Gradients` (read-only arrays; an embedding's as a
          :class:`~hostavg.SparseGradient` of unique rows) with ``.loss``,
          ``.size`` and ``.sq_norms``.
        """
        raise NotImplementedError

    def apply(self, grads: Mapping) -> int:
        """Applies ``grads`` with the optimizer once; runs no forward or backward pass.

        Args:
          grads: a :class:`~hostavg.Gradients` or any mapping with exactly the
            keys of :attr:`spec` (an edited dict); values are checked (shape,
            dtype, finite), cast to each variable's dtype and copied unless
            hostavg made them.

        The TF1 face takes a session first and, after ``grads``, a
        ``feed_dict`` for the placeholders the train op reads (a learning
        rate: ``Trainer.apply_inputs``).

        Returns:
          the step counter after the apply (TF1's global step, Keras's
          ``optimizer.iterations``): one more than before.

        Raises:
          HostavgError: for missing or extra keys, a wrong shape, a dtype that
            does not cast within its kind, non-finite values, or a placeholder
            the train op reads left unfed; nothing is applied then.
        """
        raise NotImplementedError

    def step(self, batches: Sequence, sizes: Sequence[int] | None = None,
             rows: Sequence | None = None) -> StepResult:
        """One optimizer step over a list of micro-batches: compute each, add, apply the mean.

        Atomic: if any micro-batch fails (bad data, a non-finite gradient or
        loss, an error in the framework or in a hook), nothing is applied and
        what the micro-batches assigned (:attr:`rollback_variables`) is
        restored: model, optimizer state and step counter are as they were.
        See the documentation's "How a step runs" for the order of things.

        Args:
          batches: the micro-batches, one per list entry: TF1 ``sess, feeds`` (a
            list of feed dicts); Keras ``batches`` (a list of ``(x, y)`` or
            ``(x, y, sample_weight)``). ``hostavg.split(batch, n)`` cuts one
            batch into them. With ``comm``, this rank's (possibly none).
          sizes: one number of samples per micro-batch (its weight in the
            mean), where the arrays can't tell; default their length.
          rows: one array per micro-batch of the row indices of its samples
            in your data: kept as ``MicroBatch.rows`` and named in errors
            (fit passes them).

        Returns:
          the :class:`~hostavg.StepResult`: loss, size, statistics, ``micro``.
        """
        raise NotImplementedError

    def check(self, batch, *, micro_batch_size: int | None = None) -> CheckReport:
        """Does this model's step over micro-batches equal its full-batch step? Changes nothing.

        Runs one batch whole (twice) and cut into micro-batches from the same
        weights, and compares the weighted mean of the micro-batch gradients
        with the whole batch's gradient, per variable. No apply runs, and what
        the passes assigned is restored. Random ops (dropout) draw numbers.

        Args:
          batch: one batch, as :meth:`compute` takes one.
          micro_batch_size: samples per micro-batch; default the trainer's
            (its ``micro_batch_size`` or ``micro_batches``).

        Returns:
          a :class:`~hostavg.core.check.CheckReport`: ``.ok``, the largest
          relative difference per variable, and when not ok the likely cause
          (a loss that is a sum, dropout or batch norm in training mode).
          ``str(report)`` is a one-line verdict.
        """
        raise NotImplementedError

    def per_sample(self, batch, *, rows=None, chunk_size=None):
        """One row per sample of a batch: its loss, gradient norm, cosines, or why it failed.

        Each sample is computed alone (in training mode: batch norm normalises
        a sample by itself), ``chunk_size`` samples per call where the framework
        vectorizes the per-sample gradient (JAX: ``jax.vmap``; TensorFlow:
        ``tf.vectorized_map``, on TF1 of the loss's subgraph imported per sample;
        samples of one call meet the same dropout draws), else one sample per
        call (a warning says why), in two passes (the mean gradient, then each
        sample's dot with it; a batch of one chunk in one, each sample's
        gradient dotted with the samples' sum as it is formed, where the host's
        bound on that dot's rounding allows), and changes nothing: what the
        computes assigned is restored. The mean is over the samples whose loss
        and gradient are finite. Cost and memory: docs/guides/inspecting.md,
        "Per sample".

        Args:
          batch: one batch, as :meth:`compute` takes one.
          rows: each sample's row in your data set (one distinct integer per
            sample), to index the table by; None: by position in the batch.
          chunk_size: how many samples' gradients exist at a time (within one
            call), >= 1; None: as many as 64 MiB of them hold
            (``hostavg.engine.samples.DEFAULT_CHUNK_BYTES``), 330 samples of a
            50,000-parameter float32 model.

        Returns:
          a pandas DataFrame indexed by ``row`` (with ``rows``) or ``sample``
          (position in the batch), with columns ``loss``, ``norm`` (of the
          gradient), ``cosine`` (with the mean gradient), ``cosine_to_rest``
          (with the mean gradient of the other samples: NaN with fewer than
          two), ``error`` (the text of the HostavgError its compute raised, its
          other columns NaN; missing where it computed). A sample whose loss or
          gradient is not finite has NaN cosines and is left out of the means.
        """
        raise NotImplementedError

    def hvp(self, batch, *, vectors: Mapping, micro_batch_size: int | None = None) -> Gradients:
        """The Hessian-vector product H v of a batch's mean loss; changes nothing.

        ``H v = sum_i n_i H_i v / sum_i n_i`` over the micro-batches i (H_i the
        Hessian of micro-batch i's mean loss in the trained variables, n_i its
        samples): the whole batch's product, computed by exact second derivatives
        per micro-batch (TF1: double backprop in the graph; Keras on TensorFlow:
        nested gradient tapes; JAX: ``jax.jvp`` of the gradient) and summed on the
        host in float64. In training mode as :meth:`compute` (batch norm by the
        micro-batch's moments); every product of one call starts from the same
        state (moving statistics, Keras's dropout seeds), and a TF1 graph with
        random ops, which draw anew at every call, is refused. The weights, the
        optimizer and what the forward passes assign are as before. With ``comm``,
        of this process's batch alone.

        Args:
          batch: one batch, as :meth:`compute` takes one.
          vectors: name -> an array of each trained variable's shape (the keys of
            :attr:`spec`; a :class:`~hostavg.Gradients` serves, its sparse rows densified).
          micro_batch_size: samples per micro-batch; default the trainer's cut, or
            the whole batch at once where it has none.

        Returns:
          :class:`~hostavg.Gradients` of H v (dense for every variable, an
          embedding's too; the variables' dtypes) with ``.loss`` (the batch's mean
          loss) and ``.size``.
        """
        raise NotImplementedError

    def curvature(self, batch, *, trace_samples: int = 16, top: int = 1, iterations: int = 20,
                  tolerance: float = 1e-3, seed: int = 0,
                  micro_batch_size: int | None = None) -> Curvature:
        """The curvature of a batch's mean loss: Hessian trace and top eigenvalues; changes nothing.

        From :meth:`hvp`'s products alone (:mod:`hostavg.core.curvature`): the
        trace by Hutchinson's estimator over ``trace_samples`` Rademacher probes,
        the ``top`` eigenvalues of largest magnitude by Lanczos's method, stopping
        once each one's relative residual is within ``tolerance`` or after
        ``iterations`` products. Costs ``trace_samples`` plus at most
        ``iterations`` products of the whole batch (about two computes each).

        Args:
          batch: one batch, as :meth:`compute` takes one.
          trace_samples: probes of the trace (0: none).
          top: eigenvalues wanted (0: none).
          iterations: the most Lanczos products (>= top).
          tolerance: relative residual at which an eigenvalue counts as found, in (0, 1).
          seed: of the probes and of the Lanczos start.
          micro_batch_size: as :meth:`hvp` takes it.

        Returns:
          a frozen :class:`~hostavg.Curvature`: ``trace``, ``trace_stderr``,
          ``top_eigenvalues``, ``eigenvectors``, ``converged``, ``products``, ``loss``.
        """
        raise NotImplementedError

    def evaluate(self, data, *, batch_size: int | None = None) -> dict:
        """The loss and metrics over data, sample-weighted, without training; changes nothing.

        Args:
          data: TF1 ``sess, data`` ({placeholder: array}, with ``metrics=``
            name -> scalar tensor); Keras ``x, y=None`` (and
            ``sample_weight=``), arrays or a dataset of batches, its compiled
            metrics reported.
          batch_size: samples per evaluated chunk; default 32 for samples, as
            Keras (a dataset's batches as they come).

        Returns:
          {"loss": ..., **{metric name: ...}} as floats.
        """
        raise NotImplementedError

    def fit(self, data, *, batch_size: int | None = None, micro_batch_size: int | None = None,
            epochs: int = 1, verbose="auto", callbacks=None, validation_data=None,
            validation_freq=1, shuffle: bool = True, initial_epoch: int = 0,
            steps_per_epoch: int | None = None, seed: int | None = None,
            drop_remainder: bool = False, progress=None, checkpoint_dir=None,
            checkpoint_every: int | None = None, keep_checkpoints: int = 3) -> History:
        """Trains over the data for ``epochs``, each batch one step over micro-batches.

        A short last batch is weighted by its real sample count, or dropped
        with ``drop_remainder``. Hooks and callbacks run at each step and
        epoch; see the documentation's training guide for resuming and MPI.

        Args:
          data: TF1 ``sess, data`` (a feed dict of N samples, an iterable of
            batch feed dicts, or a ``tf.data.Dataset`` of samples with
            ``inputs=``); Keras ``x, y`` (and ``sample_weight=``) as
            ``model.fit`` takes them, or a dataset of batches.
          batch_size: samples per step; default 32 for samples (as Keras),
            None where the data gives its own batches.
          micro_batch_size: samples per micro-batch; default the trainer's
            (its ``micro_batch_size`` or ``micro_batches``).
          epochs: train until this epoch (counted from ``initial_epoch``).
          verbose: "auto" (a bar on a terminal or in Jupyter, a line per epoch
            elsewhere), 0 (nothing), 1 (a bar), 2 (a line per epoch), as Keras.
          callbacks: hooks for this fit only (:class:`~hostavg.core.results.Hook`),
            after the trainer's; on the Keras face Keras callbacks too.
            Raising :class:`~hostavg.StopTraining` ends training cleanly.
          validation_data: evaluated at the end of each due epoch
            (:meth:`evaluate`) into ``val_loss`` and ``val_<metric>``, in
            chunks of ``micro_batch_size``, or with the trainer's
            ``micro_batches`` of ceil(batch_size / micro_batches) samples (32
            / micro_batches where the data gives its batches; a dataset's
            batches each cut into micro_batches); checked before the first epoch.
          validation_freq: validate every that many epochs (an int), or after
            the epochs listed (counted from 1), as Keras.
          shuffle: reorder samples each epoch by a permutation from
            (``seed``, epoch): the same seed gives the same order every run.
          initial_epoch: the epoch to start at (a checkpoint's position wins).
          steps_per_epoch: steps per epoch, the next epoch continuing the data
            where this one stopped; needed for an endless dataset.
          seed: the shuffling seed; None draws one (kept in checkpoints).
          drop_remainder: drop a last batch shorter than ``batch_size``.
          progress: hostavg's display mode, winning over ``verbose`` where
            given: one of :data:`hostavg.train.progress.PROGRESS_MODES`.
          checkpoint_dir: where checkpoints go (:meth:`save`): of the start,
            every ``checkpoint_every`` steps, at the end, and when an
            exception or SIGTERM stops fit. If it holds one, fit resumes from
            the newest: weights, optimizer, step, position, seed and history,
            bit for bit as an uninterrupted run (stateful random ops aside:
            :class:`~hostavg.ResumeWarning`).
          checkpoint_every: steps between checkpoints; None: start and end only.
          keep_checkpoints: how many of the newest checkpoints are kept.

        Returns:
          the :class:`~hostavg.History`: ``history.history`` (name -> one
          value per epoch, as Keras's), ``history.epoch`` and every step's
          statistics.

        Raises:
          HostavgError: before training, for bad arguments or data, or a
            checkpoint of another model; during training, one whose message
            starts with where it happened (epoch, batch, step) and names the
            micro-batch's data rows. Any exception leaving fit carries
            ``.history``, the History up to it.
        """
        raise NotImplementedError

    def save(self, path) -> None:
        """Writes the model's and the optimizer's variables (weights, slots, step) to ``path``.

        One ``.npz`` file written atomically (:mod:`hostavg.train.checkpoint`).

        The TF1 face takes the session first.
        """
        raise NotImplementedError

    def restore(self, path) -> dict | None:
        """Loads a checkpoint written by :meth:`save` or :meth:`fit`; returns fit's state or None.

        The TF1 face takes the session first.

        Raises:
          HostavgError: if it was written by another model; nothing changes then.
        """
        raise NotImplementedError

    @property
    def spec(self) -> dict:
        """name -> :class:`~hostavg.VariableSpec` of every trained variable."""
        return self._ready("trainer.spec").spec

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per micro-batch of fit and check, or None (``micro_batches`` cuts); checked when set."""
        return None if self._cut is None else self._cut.size

    @micro_batch_size.setter
    def micro_batch_size(self, value) -> None:
        self._cut = cut(value, self.micro_batches)

    @property
    def micro_batches(self) -> int | None:
        """How many micro-batches fit and check cut a batch into, or None; checked when set."""
        return None if self._cut is None else self._cut.count

    @micro_batches.setter
    def micro_batches(self, value) -> None:
        self._cut = cut(self.micro_batch_size, value)

    # --- How it shows itself: repr (one line) and a table in a notebook -----------------------

    def _face(self) -> dict:
        """What the face shows before the shared settings: its name under "face" and its own
        settings (the TF1 face's averaging, the Keras face's model)."""
        raise NotImplementedError

    def _settings(self) -> dict:
        """name -> value of every setting, the face's first; None where not set."""
        return {**self._face(),
                "variables": "unknown until the first batch" if self._engine is None
                else len(self.spec),
                "micro_batch_size": self.micro_batch_size, "micro_batches": self.micro_batches,
                "accumulate": self.accumulate,
                "accum_dtype": None if self.accum_dtype is None else str(self.accum_dtype),
                "hooks": ", ".join(type(h).__name__ for h in self.hooks) or None,
                "statistics": ", ".join(self.statistics.functions) or None,
                "update_ratios_every": self.update_ratios_every,
                "distributions_every": self.distributions_every,
                "overlap": self.overlap or None, "check_applied": self.check_applied,
                "processes": None if self.comm is None else self.comm.Get_size()}

    def __repr__(self) -> str:
        settings = self._settings()
        return display.summary(settings["face"], {k: settings[k] for k in _REPR if k in settings})

    def _repr_html_(self) -> str:
        settings = self._settings()
        name = settings.pop("face")
        rows = [[k, "" if v is None else v] for k, v in settings.items()]
        return display.html(name, ["setting", "value"], rows)

    # --- The engine -------------------------------------------------------------------------

    def _make_engine(self, spec) -> Engine:
        self._engine = Engine(spec, accumulate=self.accumulate, accum_dtype=self.accum_dtype,
                              hooks=self.hooks, average=self._average,
                              update_ratios_every=self.update_ratios_every, overlap=self.overlap,
                              distributions_every=self.distributions_every,
                              statistics=self.statistics)
        return self._engine

    def _engine_for(self, backend: Backend, sample, what: str) -> Engine:
        """The engine; made on the first data a backend prepares, where the backend learns its
        variables from data (a Keras model traces its gradient function on ``sample``, or on
        what ``sample()`` returns where it is a function: read only when needed)."""
        if self._engine is None:
            backend.prepare(sample() if callable(sample) else sample, None, what)
            self._make_engine(backend.spec)
        return self._engine

    def _ready(self, what: str) -> Engine:
        if self._engine is None:
            raise ArgumentError(
                f"{what} needs the trained variables, which the trainer learns from the first "
                f"batch: run compute (or step, fit, evaluate) on a batch first")
        return self._engine

    def _cut_for(self, micro_batch_size, what: str) -> Cut:
        """How ``what`` cuts a batch: by its own ``micro_batch_size`` where given, else as the
        trainer does; an error naming both where neither says."""
        how = cut(micro_batch_size) if micro_batch_size is not None else self._cut
        if how is None:
            raise ArgumentError(f"{what} needs micro_batch_size: pass it to {what}, or "
                                f"micro_batch_size or micro_batches to the trainer "
                                f"(Trainer(..., micro_batch_size=32))")
        return how

    # --- The implementations, once, over a backend and its feeds -----------------------------

    def _compute(self, backend: Backend, feed, size: int | None) -> Gradients:
        return self._engine_for(backend, feed, "compute").compute(backend, feed, size)

    def _accumulator(self, reducer=None) -> Accumulator:
        return Accumulator(self._ready("accumulator()").spec, accumulate=self.accumulate,
                           accum_dtype=self.accum_dtype, reducer=reducer)

    def _apply(self, backend: Backend, grads: Mapping, feed: Mapping) -> int:
        return self._ready("apply()").apply(backend, grads, feed)

    def _step(self, backend: Backend, feeds: Sequence, sizes, rows) -> StepResult:
        return self._for_step(backend, feeds).step(backend, feeds, sizes, rows)

    def _for_step(self, backend: Backend, feeds) -> Engine:
        if self._engine is None:  # the face checked that ``feeds`` is a list of batches
            if not feeds:
                raise ArgumentError("step got no micro-batches; pass at least one batch")
            return self._engine_for(backend, feeds[0], f"step, micro-batch 0 of {len(feeds)}")
        return self._engine

    def _check(self, backend: Backend, data, micro_batch_size: int | None,
               blocks: Mapping | None = None) -> CheckReport:
        how = self._cut_for(micro_batch_size, "check")
        n = sample_count(data, "check", blocks)
        if not n:
            leaves = [getattr(k, "name", k) for k in data] if isinstance(data, Mapping) else []
            name = backend.advice["batch_name"]
            found = ("arrays of 0 samples" if n == 0 else
                     f"only scalars: {', '.join(map(repr, leaves))}" if leaves else f"an empty {name}")
            raise ArgumentError(f"check: the {name} holds no array of samples to cut into "
                                f"micro-batches ({found}). {backend.advice['no_samples']}")
        engine = self._engine_for(backend, data, "check")
        return engine.check(backend, data, pieces(data, how.sizes(n), n, blocks), n)

    def _hvp(self, backend: Backend, data, vectors: Mapping, micro_batch_size,
             blocks: Mapping | None = None) -> Gradients:
        feeds = self._micro_feeds(backend, data, micro_batch_size, "hvp", blocks)
        return self._engine.hvp(backend, feeds, vectors)

    def _curvature(self, backend: Backend, data, settings: dict, micro_batch_size,
                   blocks: Mapping | None = None) -> Curvature:
        measured = CurvatureSettings(**settings)  # checked before any product runs
        feeds = self._micro_feeds(backend, data, micro_batch_size, "curvature", blocks)
        return self._engine.curvature(backend, feeds, measured)

    def _micro_feeds(self, backend: Backend, data, micro_batch_size, call: str,
                     blocks: Mapping | None) -> list:
        """``data`` cut as ``micro_batch_size`` or the trainer says, or whole where neither
        does; the engine made on it where there is none yet."""
        self._engine_for(backend, data, call)
        how = cut(micro_batch_size) if micro_batch_size is not None else self._cut
        n = sample_count(data, call, blocks)
        if how is None or not n:
            return [data]
        return pieces(data, how.sizes(n), n, blocks)

    def _per_sample(self, backend: Backend, data, rows, chunk_size):
        pd = pandas("per_sample")
        found = self._engine_for(backend, lambda: take(data, slice(0, 1)), "per_sample") \
            .per_sample(backend, data, rows, chunk_size)
        index = pd.RangeIndex(len(found.losses), name="sample") if rows is None \
            else pd.Index(rows, dtype="int64", name="row")
        return pd.DataFrame({"loss": found.losses, "norm": found.norms, "cosine": found.cosines,
                             "cosine_to_rest": found.cosines_to_rest, "error": found.errors},
                            index=index)

    def _evaluate(self, backend: Backend, chunks, metrics=None, listeners=None) -> dict:
        """The loss (and ``metrics``) over ``chunks``, sample-weighted, told to ``listeners``
        where given (see :class:`~hostavg.train.sources.Validation`); what the forward pass
        assigns (a counter, moving statistics in training mode) is restored. A trainer that
        has not seen a batch learns the model's variables from the first chunk."""
        chunks = iter(chunks)
        if self._engine is None:
            first = next(chunks, None)
            if first is None:
                raise ArgumentError("evaluate: the data gives no batch (it is empty)")
            self._engine_for(backend, take(first, slice(0, 1)), "evaluate")
            chunks = itertools.chain([first], chunks)
        with self._engine.leaving_no_trace(backend, "evaluate"):
            if listeners is None:
                return backend.evaluate(chunks, metrics)
            logs = backend.evaluate(listeners.validating(chunks), metrics)
            listeners.validated(logs)
            return logs

    def _fit_arguments(self, *, micro_batch_size, verbose, progress, validation_freq,
                       **kwargs) -> FitArguments:
        """fit's arguments checked, before the face reads any data: its micro-batches cut as
        :meth:`_cut_for` says, what it shows as ``verbose`` says unless ``progress`` is given."""
        freq = checked_validation_freq(validation_freq)
        how = self._cut_for(micro_batch_size, "fit")
        progress = VERBOSE[checked_verbose(verbose)] if progress is None else progress
        return fit_arguments(cut=how, progress=progress, validation_freq=freq, **kwargs)

    def _fit(self, backend: Backend, source: BatchSource, validation: Validation | None,
             arguments: FitArguments) -> History:
        """fit over the face's ``source``, evaluating ``validation`` where due."""
        self._forget_bounds()  # the weights may have been set since the last step
        return fit_loop(TrainerRun(self, backend), source, validation, arguments)

    def _save(self, backend: Backend, path, fit: dict | None = None) -> None:
        checkpoint.save(backend, path, fit=fit)

    def _restore(self, backend: Backend, path) -> dict | None:
        fit = checkpoint.restore(backend, path)
        self._forget_bounds()
        return fit

    def _forget_bounds(self) -> None:
        """The next apply is checked on the device and measures the weights and slots again
        (:meth:`Engine.forget_bounds`): they were set from outside a step."""
        if self._engine is not None:
            self._engine.forget_bounds()

    # --- What fit asks a face between steps (a face with training metrics overrides them) --

    def _reset_metrics(self, backend: Backend) -> None:
        """Starts the training metrics afresh (at each epoch's start in fit); none here."""

    def _training_metrics(self, backend: Backend) -> dict:
        """The training metrics since :meth:`_reset_metrics`, by name (fit's epoch logs); none here."""
        return {}

    def _stop_requested(self) -> str | None:
        """Why fit should end after this step, the epoch's end still run (the framework's own
        stop flag), or None."""
        return None

    def _together_entry(self, backend: Backend, feeds, sizes) -> tuple:
        """This trainer's entry of a ``step_together``: (engine, backend, feeds, sizes)."""
        return self._for_step(backend, feeds), backend, feeds, sizes


class TrainerRun:
    """A trainer bound to its backend: what fit drives (:class:`hostavg.train.loop.Run`)."""

    def __init__(self, trainer: BaseTrainer, backend: Backend):
        self.trainer, self.backend = trainer, backend
        self.comm, self.hooks, self.advice = trainer.comm, trainer.hooks, backend.advice

    def gather(self, what: str, obj) -> list:
        return self.trainer._average.gather(self.backend, what, obj)

    def random_ops(self) -> tuple:
        return tuple(self.backend.random_ops())

    def hooked(self, extra: tuple):
        return self.trainer._ready("fit").hooked(extra)

    def step(self, micro_batches: list, sizes: list | None = None, rows: list | None = None
             ) -> StepResult:
        return self.trainer._step(self.backend, micro_batches, sizes, rows)

    def global_step(self) -> int:
        return self.backend.global_step()

    def save(self, path, fit: dict) -> None:
        self.trainer._save(self.backend, path, fit)

    def restore(self, path) -> dict | None:
        return self.trainer._restore(self.backend, path)

    def evaluate(self, validation: Validation) -> dict:
        return self.trainer._evaluate(self.backend, validation.chunks, validation.metrics,
                                      validation.listeners)

    def reset_metrics(self) -> None:
        self.trainer._reset_metrics(self.backend)

    def metrics(self) -> dict:
        return self.trainer._training_metrics(self.backend)

    def stop_requested(self) -> str | None:
        return self.trainer._stop_requested()

    def abandon(self, error: BaseException) -> None:
        if self.trainer._engine is not None:
            self.trainer._engine.abandon(error)


def together_entries(steps, kind: type, call: str) -> list[tuple]:
    """``steps`` checked as ``(trainer, batches)`` or ``(trainer, batches, sizes)`` of ``kind``:
    ``(trainer, batches, sizes)`` each (none for an empty list)."""
    if isinstance(steps, (Mapping, str)) or not isinstance(steps, Sequence):
        raise ArgumentError(f"{call} takes a list of (trainer, batches) pairs, got {steps!r}")
    out = []
    for entry in steps:
        if not isinstance(entry, tuple) or len(entry) not in (2, 3) or not isinstance(entry[0], kind):
            raise ArgumentError(f"{call} takes (trainer, batches) or (trainer, batches, sizes) per "
                                f"trainer, each trainer a {kind.__module__}.{kind.__qualname__}; "
                                f"got {entry!r}")
        out.append(entry if len(entry) == 3 else (*entry, None))
    return out
