"""What every Keras backend of hostavg shares: the compiled model, its variables, metrics.

Framework-free but for Keras's own model, loss, metric and optimizer classes:
nothing here depends on Keras's backend. A batch comes in as
:mod:`hostavg.keras.batch` codes it.

The model is trained as compiled: :func:`compiled` resolves a trainer's loss
and optimizer against ``model.compile``'s and compiles the model with them,
so its loss is Keras's own ``model.compute_loss`` (strings, a dict per
output, ``loss_weights``, ``model.losses``, a subclass's override), its
metrics are the compiled ones, and ``model.save`` keeps the optimizer that
trained.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from contextlib import contextmanager
from typing import NamedTuple

import keras
import numpy as np

from hostavg.compat.keras import compile_arguments, owners
from hostavg.core.dtypes import is_float
from hostavg.core.errors import ArgumentError, HostavgError, positive_int, refused
from hostavg.core.gradients import VariableSpec
from hostavg.core.split import feed_size
from hostavg.engine.protocols import Applied, ApplyRequest, NotVectorized
from hostavg.keras import targets
from hostavg.keras.advice import ADVICE
from hostavg.keras.batch import leaves
from hostavg.keras.bounds import update_bound
from hostavg.keras.train_step import log_value, overrides_train_step

__all__ = ["BATCH_NORM_MODES", "MEAN_REDUCTIONS", "ApplyOutputs", "CompiledModel", "ModelVariables",
           "checked_optimizer", "compiled", "loss_function", "metric_results", "named_results",
           "model_errors", "traced_message"]

#: Keras loss reductions that give the micro-batch MEAN, sum_j w_j l_j / n_samples.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")

#: How BatchNormalization layers' moving statistics move. "micro": once per micro-batch, by
#: its moments (Keras's own behaviour, with its gradient accumulation too). "step": once per
#: optimizer step, by the whole batch's moments of each layer's inputs, as a full-batch
#: step moves them.
BATCH_NORM_MODES = ("micro", "step")




def compiled(model, loss, optimizer):
    """``model`` compiled for training with ``loss`` and ``optimizer``, each None for the
    model's own compiled one; returns the optimizer that trains (``model.optimizer``).

    Explicit arguments win: the model is compiled again with them, keeping what
    else it was compiled with (metrics, ``loss_weights``); an uncompiled model is
    compiled with them. Under the ``mixed_float16`` dtype policy compile wraps
    the optimizer in a ``LossScaleOptimizer``, as Keras does.

    Raises:
      HostavgError: for a loss that is not a micro-batch mean, no optimizer, or
        an optimizer hostavg cannot drive.
    """
    if loss is not None:
        _check_loss(loss)
    if optimizer is not None:
        optimizer = checked_optimizer(_optimizer(optimizer))
    if not model.compiled or (loss is not None and loss is not model.loss) or \
            (optimizer is not None and optimizer is not model.optimizer):
        given = compile_arguments(model) if model.compiled else {}
        if optimizer is None and given.get("optimizer") is None:
            raise ArgumentError(
                f"optimizer: model {model.name!r} is not compiled with one and none was given; "
                f"pass optimizer= (e.g. keras.optimizers.Adam(1e-3) or 'adam') or compile the "
                f"model with it")
        optimizer = optimizer if optimizer is not None else model.optimizer
        loss = loss if loss is not None else given.get("loss")
        if loss is not None:  # what it keeps is checked before the model changes
            _check_loss(loss)
        checked_optimizer(optimizer)
        model.compile(**{**given, "optimizer": optimizer, "loss": loss})
    if model.loss is not None:
        _check_loss(model.loss)
    return checked_optimizer(model.optimizer)


def _optimizer(optimizer):
    """An optimizer from what was given: an instance, or a name such as "adam"."""
    if isinstance(optimizer, str):
        try:
            return keras.optimizers.get(optimizer)
        except ValueError:
            raise ArgumentError(f"optimizer {optimizer!r} is not the name of a Keras optimizer "
                                f"(such as 'adam' or 'sgd')") from None
    return optimizer


def _check_loss(loss) -> None:
    """Each loss of ``loss`` (one, or a dict or list of them per output) gives the micro-batch MEAN."""
    for one in keras.tree.flatten(loss):
        if isinstance(one, keras.losses.Loss):
            if one.reduction not in MEAN_REDUCTIONS:
                raise ArgumentError(
                    f"loss {one.name!r} has reduction={one.reduction!r}, but hostavg needs the "
                    f"micro-batch MEAN: make it with reduction='sum_over_batch_size' (the default)")
        elif not (one is None or isinstance(one, str) or callable(one)):
            raise ArgumentError(
                f"loss must be a keras.losses.Loss, a loss's name (such as "
                f"'sparse_categorical_crossentropy') or a callable(y_true, y_pred), or a dict or "
                f"list of them per output; got {one!r}")


def checked_optimizer(optimizer):
    """``optimizer`` if hostavg can drive it: a Keras optimizer (a ``LossScaleOptimizer`` too)
    that does not accumulate gradients itself."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ArgumentError(
            f"optimizer must be a keras.optimizers.Optimizer (e.g. keras.optimizers.Adam(1e-3)), "
            f"got {type(optimizer).__name__}; a tf.compat.v1.train optimizer goes with "
            f"hostavg.Trainer")
    scaling = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    inner = optimizer.inner_optimizer if scaling else optimizer
    if inner.gradient_accumulation_steps:
        raise ArgumentError(
            f"optimizer has gradient_accumulation_steps={inner.gradient_accumulation_steps}, "
            f"but hostavg accumulates on the host: make the optimizer without it and pass the "
            f"micro-batches to step")
    return optimizer


def loss_function(model):
    """``loss(x, y, y_pred, sample_weight)``: the model's ``compute_loss`` for training (its
    compiled loss, weighted per output, plus ``model.losses``; or a subclass's own)."""
    if "training" in inspect.signature(model.compute_loss).parameters:
        return lambda x, y, y_pred, w: model.compute_loss(x, y, y_pred, w, training=True)
    return lambda x, y, y_pred, w: model.compute_loss(x, y, y_pred, w)  # before Keras 3.3


def metric_results(model, updated, skip=()) -> dict:
    """The results of ``model.metrics`` whose state something updated, by name: floats, or
    read-only arrays for a metric of several values (F1Score's per class), as Keras logs them.

    ``updated``: the ids of the metrics to report (those a compiled function
    of the backend updates); the others are left out rather than reported at
    their initial value. ``skip``: names left out. A metric whose result is a
    dict (the compiled metrics) gives each of its entries, as
    ``model.get_metrics_result()`` does.
    """
    metrics = [metric for metric in model.metrics if id(metric) in updated]
    return named_results(metrics, [metric.result() for metric in metrics], skip)


def named_results(metrics: list, results: list, skip=()) -> dict:
    """:func:`metric_results` of ``metrics``, whose ``result()`` gave ``results``."""
    out = {}
    for metric, result in zip(metrics, results):
        named = result.items() if isinstance(result, dict) else [(metric.name, result)]
        out.update({name: log_value(value) for name, value in named if name not in skip})
    return out


class ModelVariables:
    """What every Keras backend does alike with a model's and its optimizer's variables
    (Keras's own variable API): name them for checkpoints, read, assign, build the optimizer.

    A backend sets ``model`` and ``optimizer``.
    """

    def named_variables(self) -> dict:
        """Every variable of the model and the optimizer by its position, ``model/<i>`` and
        ``optimizer/<i>``: names that agree between processes that built the same model."""
        if not self.model.built:
            raise ArgumentError("the model is not built yet; run compute, step or fit on a batch "
                                "first, or give the model an Input")
        self.build_optimizer()
        return {**{f"model/{i:04d}": v for i, v in enumerate(self.model.variables)},
                **{f"optimizer/{i:04d}": v for i, v in enumerate(self.optimizer.variables)}}

    def variables(self, names=None) -> dict:
        named = self.named_variables()
        return {name: named[name].numpy() for name in (named if names is None else names)}

    def assign(self, values: Mapping) -> None:
        named = self.named_variables()
        for name, value in values.items():
            named[name].assign(value)

    def state_of(self, names) -> dict:
        """Each trained variable of ``names`` (paths) and its slots, by
        :func:`~hostavg.compat.keras.owners`; ArgumentError where an optimizer variable that is
        not a scalar (a counter: iterations, the learning rate) belongs to none."""
        named = self.named_variables()
        key = {id(v): name for name, v in named.items()}
        trained = [v for v in self.model.trainable_variables if v.path in self.spec]
        owner = owners(self.optimizer, trained)
        orphans = [f"{v.path!r} (shape {tuple(v.shape)})" for v in self.optimizer.variables
                   if id(v) not in owner and tuple(v.shape) != ()]
        if orphans:
            raise ArgumentError(
                f"freezing {', '.join(map(repr, names))}: which trained variable the "
                f"{type(self.optimizer).__name__} optimizer's variables {', '.join(orphans)} "
                f"belong to cannot be told (hostavg knows the slots Keras's optimizers keep per "
                f"trained variable); freeze with another optimizer, or make the variables "
                f"untrained (variable.trainable = False) before the Trainer is made")
        state = {v.path: [key[id(v)]] for v in trained}
        for v in self.optimizer.variables:
            if id(v) in owner:
                state[owner[id(v)].path].append(key[id(v)])
        return {name: tuple(state[name]) for name in names}

    def build_optimizer(self) -> None:
        """Builds the optimizer with the model's trainable variables, as Keras's fit does."""
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)


class CompiledModel(ModelVariables):
    """What every Keras backend does alike with the compiled model: Keras's own evaluation over
    chunks, and the results of the metrics something updated.

    A backend sets ``model``, ``optimizer``, ``trained_metrics`` and ``evaluated_metrics``
    (the ids of the metrics of ``model.metrics`` that its gradient functions, and its
    evaluation functions, update), traces a gradient function per input structure in
    ``_trace_compute``, runs ``test_step`` on a chunk in ``evaluate_chunk``, and
    raises HostavgError in ``refuse_strategies`` where its framework distributes the model
    (hostavg trains one device per process: ``comm=`` spans several).

    Args:
      model, loss, optimizer: as :class:`hostavg.keras.Trainer` takes them; the
        model is compiled with them (:func:`compiled`).
      check_applied: whether applies check the weights and the optimizer's state
        and undo a non-finite update (:attr:`Applied.nonfinite`).
    """

    advice = ADVICE
    increment = 1  # every apply moves optimizer.iterations by one
    #: Whether compute runs the model's own train_step (:class:`~hostavg.keras.train_step.OwnStep`).
    runs_train_step = False

    def __init__(self, model, loss, optimizer, check_applied: bool = True):
        if overrides_train_step(model) and not self.runs_train_step:
            raise ArgumentError(
                f"model {model.name!r} overrides train_step ({type(model).__qualname__}."
                f"train_step), which {type(self).__name__} never calls: hostavg.keras.Trainer "
                f"runs such a model with its own train_step per micro-batch")
        self.model = self.target = model
        self.check_applied = check_applied
        self.refuse_strategies()
        self.optimizer = compiled(model, loss, optimizer)
        scaling = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self.nonfinite = "optimizer" if scaling else "refuse"
        # Whether the optimizer scales the loss (and unscales what it applies): a
        # LossScaleOptimizer, or any optimizer made with loss_scale_factor.
        self._scales = self.nonfinite == "optimizer" or self.optimizer.loss_scale_factor is not None
        self.trained_metrics, self.evaluated_metrics = set(), set()
        self.spec = None
        self._computes = {}  # input signature -> what _trace_compute made of it
        self._targets = {}  # input signature -> the targets.Target to check in its batches
        self._bound = None  # (the UpdateBound or None, the variables it measures), once made

    def prepare(self, batch, size, what: str) -> tuple:
        """``(the compiled gradient function of the batch's structure, its arrays)``, traced
        once per structure (``_trace_compute``); and its number of samples. Refuses targets
        out of range of a sparse categorical loss (:mod:`hostavg.keras.targets`)."""
        self.refuse_strategies()
        batch, flat, signature = leaves(batch, what)
        if size is None:
            n = feed_size(batch, what)
            if n < 1:
                raise ArgumentError(f"{what}: a micro-batch must hold at least 1 sample, got {n}")
        else:
            n = positive_int(f"{what}: size", size)
        if signature not in self._computes:
            try:
                self._computes[signature] = self._trace_compute(flat, signature, what)
            except ArgumentError as error:
                said = _explained(error, self.model, batch, what)
                if said is error:
                    raise
                raise said from error.__cause__
            self._targets[signature] = targets.of(self.model, signature, flat)
        targets.check(self._targets[signature], flat, what)
        return (self._computes[signature], flat, signature), n

    def vectorizable(self) -> None:
        """Raises :class:`~hostavg.engine.protocols.NotVectorized` where this model's per-sample
        gradients cannot be computed many per call: a model that trains by its own
        ``train_step`` (whose loss hostavg does not see), or a sparse gradient (an
        ``Embedding``'s on TensorFlow: each sample's would be the whole table)."""
        if self.runs_train_step:
            raise NotVectorized(f"model {self.model.name!r} trains by its own train_step, whose "
                                f"loss hostavg does not see")
        sparse = [name for name, s in self.spec.items() if s.sparse]
        if sparse:
            raise NotVectorized(f"the gradient of {sparse[0]} is sparse (rows of a table), and "
                                f"each sample's would be dense, the whole table")

    def hvp(self, feed, vector: Mapping) -> tuple[float, dict]:
        """See :meth:`hostavg.engine.protocols.Backend.hvp`: the backend's ``_product`` of the
        loss it compiled; refused for a model that trains by its own ``train_step``, whose
        loss hostavg does not see."""
        if self.runs_train_step:
            raise ArgumentError(
                f"hvp: model {self.model.name!r} trains by its own train_step, whose loss "
                f"hostavg cannot differentiate twice; measure the curvature with a trainer of "
                f"the model compiled with its loss (hostavg.keras.Trainer(model, loss, "
                f"optimizer) on a model without train_step)")
        return self._product(feed, vector)

    def _traced_spec(self, what: str, shape, trainable: list, kept: list) -> dict:
        """The spec of a traced gradient function, checked: ``shape`` (its loss's) a scalar,
        ``kept`` ((index in ``trainable``, sparse) of each variable with a gradient) not
        empty, each trained path one variable's, and the first batch's variables (spec)."""
        if tuple(shape) != ():
            raise ArgumentError(
                f"{what}: the loss has shape {tuple(shape)}, not a scalar; give the micro-batch "
                f"MEAN (a keras.losses.Loss reduces it)")
        if not kept:
            if self.model.loss is None and not self.runs_train_step and \
                    type(self.model).compute_loss is keras.Model.compute_loss:
                raise _no_loss(what, self.model)  # on JAX, Keras's loss of no loss is 0
            raise ArgumentError(f"{what}: nothing to train: no trainable variable of the model has "
                                f"a gradient with respect to the loss")
        spec = {trainable[i].path: VariableSpec(tuple(trainable[i].shape),
                                                np.dtype(trainable[i].dtype), sparse)
                for i, sparse in kept}
        if self.spec is None:
            paths = [trainable[i].path for i, _ in kept]
            shared = sorted({p for p in paths if paths.count(p) > 1})
            if shared:
                raise ArgumentError(
                    f"trained variables share the paths {shared}; gradients are keyed by "
                    f"variable.path: give their layers distinct names")
        elif spec != self.spec:
            raise ArgumentError(
                f"{what}: with this batch's inputs the loss has gradients for other variables "
                f"({sorted(spec)}) than with the first batch's ({sorted(self.spec)}); give every "
                f"batch the same structure")
        return spec

    def weights(self) -> dict:
        """The trained variables' values as NumPy arrays, by path."""
        return {v.path: v.numpy() for v in self.model.trainable_variables
                if v.path in (self.spec or ())}

    def update_bound(self):
        """The optimizer's :class:`~hostavg.core.bounds.UpdateBound` (:mod:`hostavg.keras.bounds`)
        or None (:class:`~hostavg.engine.protocols.Bounded`): None where applies do not check,
        the model trains by its own train_step or the optimizer scales the loss. The
        learning rate is :meth:`_rate_bound`'s."""
        return self._bounded()[0]

    def _bounded(self) -> tuple:
        """(:meth:`update_bound`, the variables an apply asked for magnitudes measures, in
        order: each trained variable's roles), made once the spec is known."""
        if self._bound is None and self.spec is not None:
            bound = None
            if self.check_applied and not self.runs_train_step and self.nonfinite == "refuse":
                named = self.named_variables()
                key = {id(v): name for name, v in named.items()}
                by_path = {v.path: v for v in self.model.trainable_variables}
                optimizer = self.optimizer
                bound = update_bound(optimizer, [by_path[n] for n in self.spec], self.spec, key,
                                     self._rate_bound)
            measured = [] if bound is None else [named[n] for n in bound.measured]
            self._bound = (bound, measured)
        return self._bound or (None, [])

    @staticmethod
    def traced(request: ApplyRequest) -> ApplyRequest:
        """The form of ``request`` a compiled apply is traced for (each form compiles once):
        proven only where it measures nothing (an apply that measures the ratios or keeps the
        values keeps the weights whole anyway, and is checked); measuring wherever it is
        checked and an update bound exists (:meth:`_bounded`)."""
        return ApplyRequest(request.ratios, request.values,
                            request.proven and not (request.ratios or request.values))

    def _rate_bound(self, feed) -> float | None:
        """The learning rate the next apply uses, read on the host (a schedule's at this
        iteration); a backend for which that read costs may return a bound it then enforces."""
        return float(np.asarray(self.optimizer.learning_rate))

    def _magnitudes(self, found) -> dict | None:
        """name (of :meth:`variables`) -> the largest magnitude of each variable an apply
        measured (``found``: one value each, in :meth:`_bounded`'s order), or None where it
        measured none."""
        bound = self._bounded()[0]
        if bound is None or not len(found):
            return None
        return dict(zip(bound.measured, np.asarray(found, np.float64).tolist()))

    def _checks(self, variable) -> bool:
        """Whether an apply checks ``variable`` finite: a float one (bfloat16 too, which NumPy
        counts as kind "V"), where applies check."""
        return self.check_applied and is_float(variable.dtype)

    def _report(self, out: ApplyOutputs, request: ApplyRequest, trained: list) -> Applied:
        """What an apply did, from its outputs ``out`` (on the host; ``trained``: the variables
        of spec, in order): where it found any variable it checks (of the ``trained`` ones,
        then the optimizer's) not finite and undid the update, their names, by path; for a
        LossScaleOptimizer that did not move, that it skipped the step, with its scales before
        and after; else the new ``optimizer.iterations``, the learning rate and what
        ``request`` asked for."""
        if not out.finite.all():
            held = [v for v in [*trained, *self.optimizer.variables] if self._checks(v)]
            return Applied(out.before,
                           nonfinite=tuple(v.path for v, ok in zip(held, out.finite) if not ok))
        if out.before == out.after and self.nonfinite == "optimizer":
            return Applied(out.after, None, out.learning_rate, skipped=(
                f"the LossScaleOptimizer skipped the step: the gradients were not finite at "
                f"loss scale {out.scales[0]:g}, which it lowered to {out.scales[1]:g}"))
        return Applied.of(list(self.spec), out.after, out.learning_rate, request, out.squares,
                          out.weights, out.updates)._replace(
                              magnitudes=self._magnitudes(out.magnitudes))

    def _took(self, names, values) -> None:
        """What a compute returned besides its gradients: the logs ``names`` (none here)."""

    def evaluate(self, chunks, metrics=None) -> dict:
        """Keras's own evaluation over ``chunks`` (batches; any iterable): the model's metrics
        reset, then ``test_step`` per chunk (the loss, weighted by each chunk's samples, and the
        compiled metrics); the results of the metrics it updated. ``metrics`` is TF1's: a Keras
        model's metrics are those it was compiled with."""
        self.refuse_strategies()
        self.model.reset_metrics()
        count = len(chunks) if hasattr(chunks, "__len__") else None
        for i, chunk in enumerate(chunks):
            what = f"evaluate, chunk {i}{'' if count is None else f' of {count}'}"
            self.evaluate_chunk(chunk, what)
        return self.evaluation_results()

    def evaluation_results(self) -> dict:
        """The results of the metrics evaluation updated, by name ("loss" and the compiled ones)."""
        return metric_results(self.model, self.evaluated_metrics)

    def training_results(self) -> dict:
        """The results of the metrics the gradient functions update, by name (the compiled
        metrics, each output's loss), but "loss": fit's is the steps' own."""
        return metric_results(self.model, self.trained_metrics, skip=("loss",))


class ApplyOutputs(NamedTuple):
    """What a Keras backend's compiled apply gives back, by name: numbers and NumPy arrays on
    the host (tensors within a compiled TensorFlow function).

    Attributes:
      before, after: ``optimizer.iterations`` before and after the apply.
      learning_rate: the learning rate the apply used.
      squares: the updates' squared norms, then the weights' before (empty unless
        ``ApplyRequest.ratios``).
      scales: the loss scale before and after (1.0 without loss scaling).
      weights, updates: each trained variable's value after the apply, and its update,
        in the spec's order (empty unless ``ApplyRequest.values``).
      finite: whether each variable the apply checks is finite after the update (empty
        unless applies check).
      magnitudes: the largest magnitude of each variable :meth:`CompiledModel._bounded`
        measures, after the update (empty unless ``ApplyRequest.magnitudes``).
      ran: whether the optimizer ran (a proven apply on TensorFlow does not where the
        learning rate passed the bound it was proven for: it is then run checked).
    """

    before: int
    after: int
    learning_rate: float
    squares: np.ndarray
    scales: tuple
    weights: list
    updates: list
    finite: np.ndarray
    magnitudes: np.ndarray = np.zeros(0)
    ran: bool = True


def _explained(error: ArgumentError, model, batch: tuple, what: str) -> ArgumentError:
    """``error``, of a ``model`` that cannot run on ``batch`` (:func:`model_errors`), said by
    its cause where it is known: a model with no loss at all, or one loss for several outputs
    of which one has another shape than its target; else ``error`` itself."""
    fact = getattr(error, "fact", None)
    if fact is None:
        return error
    if "No loss to compute" in str(error.__cause__):
        return _no_loss(what, model)
    misfit = _misfit_output(model, batch)
    if misfit is None:
        return error
    return ArgumentError(f"{fact}; {misfit}. Give each output a target of its shape, or each "
                         f"output its own loss (a dict by output name)")


def _no_loss(what: str, model) -> ArgumentError:
    """The error of a ``model`` that has no loss at all."""
    return ArgumentError(
        f"{what}: model {model.name!r} has no loss: it is compiled without one, none was given, "
        f"and its forward pass adds none (add_loss); pass loss= (such as "
        f"'sparse_categorical_crossentropy') or compile the model with one")


def _misfit_output(model, batch: tuple) -> str | None:
    """Where ``model`` has several outputs and one loss (which Keras applies to each), the first
    output whose shape its target in ``batch`` does not have (of the same rank, another size
    past axis 0), in words; else None."""
    outputs = getattr(model, "outputs", None) or []
    if len(outputs) < 2 or keras.tree.is_nested(model.loss) or len(batch) < 2:
        return None
    names, y = model.output_names, batch[1]
    if isinstance(y, Mapping):
        given = [y.get(name) for name in names]
    elif isinstance(y, (list, tuple)) and len(y) == len(names):
        given = list(y)
    else:
        return None
    for name, output, target in zip(names, outputs, given):
        shape, got = tuple(output.shape), np.shape(target)
        if target is not None and len(shape) == len(got) and any(
                s is not None and s != g for s, g in zip(shape[1:], got[1:])):
            return (f"model {model.name!r} has {len(names)} outputs "
                    f"({', '.join(map(repr, names))}) and one loss, which Keras applies to each "
                    f"of them: output {name!r} gives shape {shape}, its target {got}")
    return None


def traced_message(error) -> str:
    """What went wrong, from an error raised while a model is traced: TensorFlow's autograph
    wraps it in a traceback ("in user code: ... ValueError: what went wrong"), and Keras adds
    which call it was and the arguments it received (left out: they would hide the cause)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).strip().splitlines()]
    if not lines:
        return type(error).__name__
    said, start = f"{type(error).__name__}: ", 0
    if lines[0].startswith("in user code:"):
        start = max((i for i, line in enumerate(lines) if line.startswith(said)),
                    default=len(lines) - 1)
    body = []
    for line in [lines[start].removeprefix(said)] + lines[start + 1:]:
        if line.startswith("Arguments received by"):
            break
        if line and not line.startswith("Exception encountered when calling"):
            body.append(line)
    return " ".join(body) or lines[start].removeprefix(said)


@contextmanager
def model_errors(what: str, message):
    """Turns an error building or tracing the model on a batch into an ArgumentError naming the
    batch (refused before anything ran); ``message(error)`` is what went wrong, in the
    backend's own way of telling."""
    try:
        yield
    except HostavgError:
        raise
    except Exception as error:
        raise refused(f"{what}: the model cannot run on this batch ({type(error).__name__}: "
                      f"{message(error)})",
                      "check its x and y against the model's inputs and the loss",
                      ArgumentError) from error
