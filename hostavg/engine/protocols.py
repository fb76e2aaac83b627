"""What the engine needs of a framework (:class:`Backend`) and of an averaging (:class:`Average`),
and the small records they exchange. Pure Python: a new backend implements these."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from hostavg.core.accumulator import Reducer
from hostavg.core.bounds import UpdateBound
from hostavg.core.check import RandomOp
from hostavg.core.gradients import VariableSpec
from hostavg.core.stats import update_ratio

__all__ = ["AVERAGE_MODES", "NONFINITE_MODES", "ApplyRequest", "Applied", "Average", "Backend",
           "Bounded", "Computed", "Fused", "HostAverage", "Many", "NotVectorized", "SampleStats",
           "SampleSums", "Tally", "Vectorized"]


#: Where a trainer computes the mean of the accumulated gradients. "host":
#: with NumPy. "graph": in the session, as a division of the fed running sum
#: ("sum") or a weighted reduce over a fed stack of micro-batch gradients ("stack").
AVERAGE_MODES = ("host", "graph")

#: What a step does with a micro-batch whose loss or gradients hold NaN or Inf (one that no
#: hook dropped), as its backend says. "refuse": the step raises, naming the micro-batch, and
#: nothing is applied. "optimizer": the step goes on, and its mean goes to the optimizer,
#: which skips a non-finite update itself and says so (``Applied.skipped``): a loss-scaling
#: optimizer (Keras's ``LossScaleOptimizer``) then lowers its scale.
NONFINITE_MODES = ("refuse", "optimizer")


class Computed(NamedTuple):
    """One micro-batch as a backend computed it.

    Attributes:
      loss: its mean loss (a float, or a 0-d array).
      grads: name -> frozen array or SparseGradient of frozen arrays
        (:func:`~hostavg.core.gradients.freeze`), exactly the spec's names.
      global_step: the global step before this step's apply.
      sq_norms: name -> squared L2 norm of each gradient (sparse rows
        coalesced), reduced where the values were made.
      fetched: the values of the extra tensors the backend was asked to
        fetch (:attr:`~hostavg.core.results.MicroBatch.fetched`), read-only.
    """

    loss: Any
    grads: dict
    global_step: int
    sq_norms: dict
    fetched: tuple = ()


class ApplyRequest(NamedTuple):
    """What an apply is asked for besides applying (:meth:`Backend.apply`), from the same call.

    Attributes:
      ratios: the update-to-weight ratios (``Applied.update_ratios``).
      values: the weights after the apply and the updates (``Applied.weights``,
        ``Applied.updates``).
      proven: the engine proved on the host that this apply leaves every weight and slot
        finite (:mod:`hostavg.engine.proof`): a backend that checks its applies runs this one
        unchecked, keeping nothing to undo with.
      magnitudes: a checked apply measures, after it, the largest magnitude of each variable
        its :meth:`Bounded.update_bound` names (``Applied.magnitudes``).
    """

    ratios: bool = False
    values: bool = False
    proven: bool = False
    magnitudes: bool = False


class Applied(NamedTuple):
    """What a backend's apply reports: every backend's, so what follows an apply is written once.

    Attributes:
      global_step: the global step after the apply.
      update_ratios: name -> |w_after - w_before| / |w_before| of each trained
        variable (L2 norms over the whole variable, reduced where the values
        live, in the same call as the apply); 0 where nothing moved, inf where
        a variable of norm 0 moved. None where the backend cannot tell.
      learning_rate: the optimizer's learning rate as this apply used it (a
        schedule's value at this step), or None where the optimizer exposes none.
      skipped: why the optimizer left the variables as they were (a backend whose
        ``nonfinite`` is "optimizer", given a non-finite mean), or None: applied.
      weights, updates: name -> each trained variable's value after the apply, and
        after minus before (NumPy arrays, read in the same call as the apply),
        where the apply was asked for them (``ApplyRequest.values``); else None.
      nonfinite: the names of the trained variables and optimizer variables
        (slots, moments, iterations, loss scale) that the update made NaN or
        Inf, found in the apply's own call, which then undid the update: every
        one of them, the global step too, is as before it (the other fields
        are then their defaults). () where all are finite, or the backend was
        made not to check.
      weight_norms: name -> |w_before| of each trained variable (L2, read in the same
        call), where the ratios were; else None.
      magnitudes: name (of :meth:`Backend.variables`) -> the largest magnitude of its
        entries after the apply, of each variable of the backend's
        :meth:`Bounded.update_bound`, where the apply was asked (``ApplyRequest.magnitudes``)
        and could measure them; else None.
    """

    global_step: int
    update_ratios: dict | None = None
    learning_rate: float | None = None
    skipped: str | None = None
    weights: dict | None = None
    updates: dict | None = None
    nonfinite: tuple = ()
    weight_norms: dict | None = None
    magnitudes: dict | None = None

    @classmethod
    def of(cls, names: Sequence[str], global_step: int, learning_rate: float | None,
           request: ApplyRequest, squares=(), weights=(), updates=()) -> Applied:
        """The report of an apply that went through, from what its call read, each in
        ``names``' order: ``squares``, the updates' squared norms then the weights' before
        (made the ratios where ``request.ratios``); ``weights`` after and ``updates`` (kept
        by name where ``request.values``)."""
        ratios = norms = None
        if request.ratios:
            squares, k = [float(q) for q in squares], len(names)
            ratios = {name: update_ratio(u, w)
                      for name, u, w in zip(names, squares[:k], squares[k:])}
            norms = {name: math.sqrt(w) for name, w in zip(names, squares[k:])}
        if not request.values:
            return cls(global_step, ratios, learning_rate, weight_norms=norms)
        return cls(global_step, ratios, learning_rate, None, dict(zip(names, weights)),
                   dict(zip(names, updates)), weight_norms=norms)


class SampleStats(NamedTuple):
    """Per sample of a feed (:meth:`Engine.per_sample`), in order.

    Attributes:
      losses: each sample's loss (NaN where its compute failed).
      norms: each sample's gradient norm (NaN or Inf where non-finite).
      cosines: each sample's cosine with the mean gradient of the feed's
        samples whose loss and gradient are finite (NaN for the others, and
        where a norm is 0).
      cosines_to_rest: each sample's cosine with the mean gradient of the
        OTHER such samples (:func:`hostavg.stats.cosines_to_rest`; NaN where
        ``cosines`` is, and with fewer than two such samples).
      errors: where a sample's compute failed, its error's text; else None.
    """

    losses: tuple
    norms: tuple
    cosines: tuple
    cosines_to_rest: tuple
    errors: tuple


class SampleSums(NamedTuple):
    """The samples of one prepared feed, each computed alone (:meth:`Vectorized.sample_sums`).

    Attributes:
      losses: (n,) float64, each sample's loss.
      sq_norms: (n,) float64, |g_i|^2 of each sample's gradient g_i (NaN or Inf where
        non-finite).
      sums: name -> sum_i g_i over the n samples, dense, of each trained variable's shape.
      dots: (n,) float64, g_i . S with S the sum of the n gradients (``sums``), where the
        call was asked for them, else None.
    """

    losses: Any
    sq_norms: Any
    sums: dict
    dots: Any = None


class NotVectorized(Exception):
    """Raised by a :class:`Vectorized` method that cannot compute a feed's samples many per
    call (an op without a vectorized rule, a model that refuses); its text says why. The
    engine then computes them one at a time (:meth:`Backend.compute` of each)."""


class Vectorized(Protocol):
    """What a backend may add for :meth:`Engine.per_sample`: each sample of a prepared feed
    computed alone, many per call, in training mode as :meth:`Backend.compute` (batch norm
    by the sample's own moments), from the same state for every sample and every call
    (what the forward pass would assign is not assigned), nothing per sample kept after
    the call. Samples then meet the same random draws (dropout) within a call."""

    def sample_sums(self, feed, dotted: bool = False) -> SampleSums:
        """Each sample's loss and squared gradient norm, and the sum S of their gradients; with
        ``dotted``, also each g_i . S (:attr:`SampleSums.dots`, in the variables' dtype), from
        the gradients the call forms."""

    def sample_dots(self, feed, mean: Mapping) -> Any:
        """(n,) float64: g_i . ``mean`` for each sample (``mean``: name -> float64 array of
        each trained variable's shape)."""


class Bounded(Protocol):
    """What a backend may add so that the engine can prove an apply finite on the host and run
    it without the device-side check (:mod:`hostavg.engine.proof`); a backend whose applies
    check measures, in an apply asked to (``ApplyRequest.magnitudes``), the variables it
    names, and runs one asked ``proven`` unchecked."""

    def update_bound(self) -> UpdateBound | None:
        """The optimizer's update rule and the variables it reads and writes
        (:class:`~hostavg.core.bounds.UpdateBound`), or None where applies are not checked or
        the optimizer's update is not one of :mod:`hostavg.core.bounds`' rules (then every
        apply is checked on the device)."""


class Fused(Protocol):
    """What a backend may add so that a step of one micro-batch costs one call: its compute and
    its apply together, the apply unchecked and gated on the device by what the engine allows
    (:meth:`~hostavg.engine.step.Engine.step`; the engine asks only where no hook, statistic
    or measurement must see the gradient before the apply)."""

    #: Whether the backend can run a step of one micro-batch in one call (TF1: no more
    #: fetches to wait for, the mean not averaged in the graph).
    fuses: bool
    #: Whether the backend's applies are checked (``check_applied``): then the engine allows
    #: a fused apply only the gradient bound its proof gives (:meth:`Proof.allowance
    #: <hostavg.engine.proof.Proof.allowance>`); else any finite gradient.
    checks: bool

    def compute_apply(self, feed, allowance: float) -> tuple[Computed, Applied] | None:
        """:meth:`Backend.compute` of ``feed`` and, in the same call, the unchecked apply of its
        gradients, which runs only where its loss is a finite scalar and the L2 norm of all
        its gradients, times sqrt(rows) of its sparse one with the most, is at most
        ``allowance`` (:meth:`Proof.allowance <hostavg.engine.proof.Proof.allowance>`): (what
        the compute gave, what the apply reported, or None where the gate refused it: the
        engine then checks the gradients as any compute's and applies them apart). None where
        the call failed: what the compute assigns may have moved; the engine restores it and
        computes again apart. Asked only where :attr:`fuses`."""


class Many(Protocol):
    """What a backend may add so that several micro-batches of a step cost one call: their
    computes in turn in one compiled call, each from the state the one before it left (moving
    statistics, random seeds, metrics), as one compute after another would leave it. The
    engine asks where no hook may drop a micro-batch (each then needs its own snapshot) or
    read the model (it would see the state the call's last compute left), and the step's
    computes are not overlapped; it shows them to the hooks, checks them and adds
    them one by one, as it does computes made one at a time. Where one fails the step, the
    state it left is restored before its samples are searched, so that the search draws the
    random numbers it would have drawn after that compute alone."""

    def compute_many(self, feeds: Sequence, shares: Sequence[float]) -> list[tuple]:
        """:meth:`Backend.compute` of the first m of ``feeds`` (their ``shares``) in one call,
        in order, m >= 0 as the backend chooses (feeds of one input signature, their
        gradients within the memory it allows such a call): for each, (its
        :class:`Computed`, or a function that gives it, called once as the engine takes it
        in order, so that computes may still run while those before are added; a function
        that gives the rollback snapshot as that compute left it, which
        :meth:`Backend.restore` takes). Equal to m computes one after another, to the
        rounding of the framework's compiler (which may fuse the same arithmetic otherwise in
        one larger program), and leaving what they assign as the last of them would. Raises
        what :meth:`Backend.compute` raises; then nothing is assigned, and the engine
        computes them one at a time, which names the micro-batch that failed. A function
        that gives a Computed raises what :meth:`Backend.compute` raises, the state then as
        the computes before it left it."""


class Backend(Protocol):
    """What the engine needs of a framework: one model, bound to where its values live.

    Errors of the framework are raised as a :class:`~hostavg.StepError` (it
    failed or refused to run) or an :class:`~hostavg.ArgumentError` (a batch
    whose form it refuses before anything runs), whose message says what failed
    and what to do, without saying where (the engine adds the micro-batch).
    """

    #: name -> VariableSpec of every trained variable.
    spec: Mapping[str, VariableSpec]
    #: How much an apply adds to the global step: 1, or 0 for a trainer that
    #: leaves the step to another (the second network of a GAN).
    increment: int
    #: The object that holds the variables' values (a TF1 session, a Keras
    #: model): an Average keeps it weakly, to know whether it met it before.
    target: Any
    #: What to do about each cause a failed check finds, in the words of the framework:
    #: cause -> advice, for every cause of :data:`hostavg.core.check.CAUSES`; and the
    #: framework's word for every key of :data:`hostavg.core.words.WORDS`, which the messages
    #: of the framework-free layers use where frameworks differ.
    advice: Mapping[str, str]
    #: What a non-finite micro-batch does to a step: one of :data:`NONFINITE_MODES`.
    nonfinite: str

    def prepare(self, feed, size: int | None, what: str) -> tuple[Any, int]:
        """The feed made ready to compute, and its number of samples (``size`` if given).

        Where it refuses some of the feed's samples (a target out of range), it
        raises :func:`hostavg.engine.batches.refused`'s error, which names them
        by their place in the feed until the engine names their data rows."""

    def compute(self, feed, share: float = 1.0) -> Computed:
        """Forward, backward and the update ops of one micro-batch; changes no trained variable.

        ``share``: the micro-batch's part of its step's samples (n / N). A backend
        whose optimizer scales the loss (``LossScaleOptimizer``) scales this
        micro-batch's loss by it too, so that what the backward pass meets per
        sample (the loss scale over N) is what the whole batch's step meets, and
        overflows where that overflows; its gradients are still the micro-batch's
        mean. Other backends ignore it."""

    def hvp(self, feed, vector: Mapping) -> tuple[float, dict]:
        """(the mean loss of one micro-batch, name -> H v) for ``feed`` (prepared) and
        ``vector`` (name -> a float64 array of each trained variable's shape), H the Hessian
        of that loss in the trained variables: exact second derivatives (double backprop, or
        forward over reverse), in training mode as :meth:`compute`, dense for a sparse
        variable. What its forward pass assigns may move; the engine restores it."""

    def random_ops(self) -> Sequence[RandomOp]:
        """The random ops :meth:`compute` runs, for the check's advice; () where the backend
        cannot tell."""

    def apply_feed(self, feeds: Sequence, what: str) -> dict:
        """What the apply must be fed besides the mean, taken from ``feeds`` (prepared feeds).

        The values every one of ``feeds`` gives to the inputs the optimizer
        reads (a learning-rate placeholder), by name: small and picklable, so
        ranks can compare them. Raises HostavgError naming the input when the
        optimizer needs one that ``feeds`` lack or give different values.
        """

    def apply(self, mean: Mapping, feed: Mapping, request: ApplyRequest) -> Applied:
        """Runs the optimizer once on ``mean`` (conformed; finite unless :attr:`nonfinite` is
        "optimizer"), fed ``feed`` (from :meth:`apply_feed`); returns the new global step, the
        learning rate and what ``request`` asks for, read in the same call, or why the
        optimizer skipped the update. A backend made to check its applies
        (``check_applied``) checks the updated variables and optimizer state for NaN and Inf
        in the same call and undoes the update there where it finds any
        (:attr:`Applied.nonfinite`)."""

    def global_step(self) -> int:
        """The global step now."""

    def evaluate(self, chunks: Sequence, metrics=None) -> dict:
        """The loss (and the backend's metrics) over ``chunks`` (batches in the face's form),
        sample-weighted: {"loss": float, name: float, ...}; runs no gradient."""

    def snapshot(self) -> Any:
        """The values of every variable :meth:`compute` may assign (None if there are none)."""

    def restore(self, snapshot) -> None:
        """Sets those variables back to a :meth:`snapshot`."""

    def variables(self, names: Sequence[str] | None = None) -> dict:
        """Every variable's value (model, optimizer state, global step) by name, in a fixed
        order; or only those ``names`` names. Arrays of their own: no later apply changes them."""

    def weights(self) -> dict:
        """The trained variables' values by their names in :attr:`spec`."""

    def assign(self, values: Mapping) -> None:
        """Sets each variable ``values`` names (:meth:`variables`' names) to its value there."""

    def state_of(self, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """For each trained variable of ``names`` (of :attr:`spec`): the names in
        :meth:`variables` of it, then of every optimizer variable that is its alone (Adam's
        m and v, a momentum: its slots); not the optimizer's counters. ArgumentError naming
        the optimizer where which variable a slot belongs to cannot be told."""


class Tally(NamedTuple):
    """A step's bookkeeping: this process's, or (over MPI) every rank's together.

    Attributes:
      weights, sq_norms: of each accumulated micro-batch.
      norms, losses: of each micro-batch, dropped ones too.
      total: sum of the weights.
      loss_sum: sum_i w_i loss_i (None if a loss was missing).
      size: samples accumulated.
      global_step: before the apply (None where no micro-batch ran).
      apply_feed: what the apply is fed (:meth:`Backend.apply_feed`; None
        where no micro-batch ran).
    """

    weights: list
    sq_norms: list
    norms: list
    losses: list
    total: float
    loss_sum: float | None
    size: int
    global_step: int | None
    apply_feed: dict | None = None


class Average(Protocol):
    """Where the mean of a step is computed; chosen once, when a trainer is made. A method is
    given the backend it serves, whose words (:attr:`Backend.advice`) its errors use."""

    #: Whether this process holds every micro-batch of the step (then the
    #: statistics that need every micro-batch's gradients can be computed).
    sees_every_micro_batch: bool
    #: Whether the mean of a step of one micro-batch is that micro-batch's gradient itself,
    #: computed by nobody (then a :class:`Fused` backend may apply it in its compute's call).
    passes_one_through: bool

    def begin(self, backend: Backend) -> None:
        """Called before each step (over MPI: the first step of a target takes rank 0's values)."""

    def combine(self, backend: Backend, tally: Tally | None, error: BaseException | None) -> Tally:
        """The step's tally; raises if this process (or any rank) failed with ``error``."""

    def reducer(self, backend: Backend, total: float) -> Reducer | None:
        """The reducer that turns the accumulator's sums into the mean over ``total`` weight (None: NumPy)."""

    def abandon(self, error: BaseException) -> None:
        """This process leaves a step, or the loop around it, with ``error`` (over MPI: if the
        other ranks did not raise it too, the job must end, or they would wait forever)."""

    def gather(self, backend: Backend, what: str, obj) -> list:
        """Every process's ``obj`` (small, picklable), in rank order, once every one is at
        ``what`` (such as "the end of epoch 2 of fit"); over MPI a HostavgError on every rank
        when some rank is elsewhere (such as in a step)."""


class HostAverage:
    """One process; the mean is computed on the host with NumPy."""

    sees_every_micro_batch = True
    passes_one_through = True

    def begin(self, backend: Backend) -> None:
        pass

    def combine(self, backend: Backend, tally: Tally | None, error: BaseException | None) -> Tally:
        if error is not None:
            raise error
        return tally

    def reducer(self, backend: Backend, total: float) -> Reducer | None:
        return None

    def abandon(self, error: BaseException) -> None:
        pass

    def gather(self, backend: Backend, what: str, obj) -> list:
        return [obj]
