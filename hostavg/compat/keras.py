"""Keras's private APIs that hostavg uses, each detected at import, each with a public fallback.

Imported by :mod:`hostavg.keras` only. Each wrapper is the private form where the private API
exists (Keras's own code still reads or writes it), else its public fallback;
``HOSTAVG_PUBLIC_API_ONLY=1`` makes it the fallback (see :mod:`hostavg.compat`). Detection
reads Keras's code objects only: it makes no variable, so it initialises no device. Each,
private API; fallback:

* :func:`compile_arguments`: ``Model._compile_config``, ``compile``'s very arguments; the
  public ``get_compile_config()`` deserialized gives equal objects, made anew.
* :func:`initial_epoch`: ``Model._initial_epoch``, where ``BackupAndRestore`` says training
  resumes; the fallback says None (training starts at fit's ``initial_epoch``).
* :func:`unbuilt`: ``Model._symbolic_build``'s test (a layer, the compiled loss or metrics
  not built); the fallback sees no unbuilt compiled loss.
* :func:`owners`: each slot's variable, by ``Optimizer._trainable_variables``; the fallback
  by ``add_variable_from_reference``'s names (Adafactor's moments lack them).
* :func:`assign`: compiled outputs written by ``Variable._direct_assign``; the fallback
  ``Variable.assign``, which converts and checks each (about 10 us a variable on JAX).
"""

from __future__ import annotations

import inspect

import keras

from hostavg.compat import choose

__all__ = ["assign", "compile_arguments", "initial_epoch", "owners", "unbuilt"]


def _names(function) -> tuple:
    """The attribute names ``function``'s own code reads or writes (past its decorators)."""
    return inspect.unwrap(function).__code__.co_names


# --- The arguments a model was compiled with ------------------------------------------------


def _compile_arguments_private(model) -> dict:
    """``model.compile``'s arguments, as given, by ``Model._compile_config``."""
    return dict(model._compile_config.config)  # pylint: disable=protected-access


def _compile_arguments_public(model) -> dict:
    """``model.compile``'s arguments, from its public ``get_compile_config()``, deserialized."""
    return keras.saving.deserialize_keras_object(model.get_compile_config())


def _compile_arguments_works() -> bool:
    return "_compile_config" in _names(keras.Model.compile) \
        and "_compile_config" in _names(keras.Model.get_compile_config)


compile_arguments = choose("keras.Model._compile_config", _compile_arguments_private,
                           _compile_arguments_public, _compile_arguments_works)


# --- Values a compiled function made, written into their variables --------------------------


def _assign_private(variables, values) -> None:
    """Each of ``values`` into its variable of ``variables``: by ``Variable._direct_assign``, what
    ``assign`` ends with, where the value has the variable's shape and dtype already (not
    JAX's weak type, which ``assign`` makes strong); else by ``assign``, which converts it."""
    for v, value in zip(variables, values):
        if getattr(value, "dtype", None) == v.dtype and tuple(value.shape) == tuple(v.shape) \
                and not getattr(value, "weak_type", False):
            v._direct_assign(value)  # pylint: disable=protected-access
        else:
            v.assign(value)


def _assign_public(variables, values) -> None:
    """Each of ``values`` into its variable of ``variables`` by ``Variable.assign``."""
    for v, value in zip(variables, values):
        v.assign(value)


def _assign_works() -> bool:
    return "_direct_assign" in _names(keras.Variable.assign)


assign = choose("keras.Variable._direct_assign", _assign_private, _assign_public, _assign_works)


# --- Where BackupAndRestore says training resumes ---------------------------------------------


def _initial_epoch_private(model) -> int | None:
    """The epoch a callback (``BackupAndRestore``) set for training to resume at, by
    ``Model._initial_epoch``, or None."""
    return getattr(model, "_initial_epoch", None)


def _initial_epoch_public(model) -> None:
    """None: no public API tells where a restored backup says training resumes."""
    return None


def _initial_epoch_works() -> bool:
    return "_initial_epoch" in _names(keras.Model.fit) \
        and "_initial_epoch" in _names(keras.callbacks.BackupAndRestore._load_model)


initial_epoch = choose("keras.Model._initial_epoch", _initial_epoch_private,
                       _initial_epoch_public, _initial_epoch_works)


# --- Whether Keras's fit would build the model from a first batch ----------------------------


def _unbuilt_private(model) -> bool:
    """Whether Keras's ``Model._symbolic_build`` builds something (and so, in Keras's fit on
    JAX, reads a first batch): a layer (``_flatten_layers``), the compiled loss
    (``_compile_loss``) or the compiled metrics (``_compile_metrics``) not built."""
    # pylint: disable=protected-access
    loss, metrics = model._compile_loss, model._compile_metrics
    return (not all(layer.built for layer in model._flatten_layers())
            or (metrics is not None and not metrics.built) or (loss is not None and not loss.built))


def _unbuilt_public(model) -> bool:
    """Whether the model, or a metric of ``model.metrics`` (its compiled metrics), is not built;
    a compiled loss not yet built goes unseen."""
    return not model.built or any(getattr(m, "built", True) is False for m in model.metrics)


def _unbuilt_works() -> bool:
    return {"_flatten_layers", "_compile_loss", "_compile_metrics"} <= set(
        _names(keras.Model._symbolic_build))


unbuilt = choose("keras.Model._symbolic_build", _unbuilt_private, _unbuilt_public, _unbuilt_works)


# --- Which trained variable each optimizer variable belongs to -------------------------------


def _optimizers(optimizer) -> list:
    """``optimizer`` and the optimizers it holds (a LossScaleOptimizer's inner one, a
    MultiOptimizer's), each once."""
    found, todo = [], [optimizer]
    while todo:
        one = todo.pop()
        if any(one is f for f in found):
            continue
        found.append(one)
        for value in vars(one).values():
            held = value if isinstance(value, (list, tuple)) else [value]
            todo += [v for v in held if isinstance(v, keras.optimizers.Optimizer)]
    return found


def _owners_private(optimizer, trained: list) -> dict:
    """id of an optimizer variable -> the variable of ``trained`` it belongs to: by every list
    an optimizer keeps per trained variable, aligned with its ``_trainable_variables`` (its
    ``_get_variable_index``), entries None or its own variables."""
    out, wanted = {}, {id(v) for v in trained}
    for one in _optimizers(optimizer):
        # pylint: disable=protected-access
        mine, order = {id(v) for v in one.variables}, list(one._trainable_variables)
        for name, value in vars(one).items():
            if name in ("_variables", "_trainable_variables") or \
                    not isinstance(value, (list, tuple)) or len(value) != len(order):
                continue
            if all(s is None or id(s) in mine for s in value):
                out.update((id(s), v) for s, v in zip(value, order)
                           if s is not None and id(v) in wanted)
    return out


def _owners_public(optimizer, trained: list) -> dict:
    """id of an optimizer variable -> the variable of ``trained`` it belongs to: the one of its
    shape whose path, '/' made '_', begins its name, as ``add_variable_from_reference`` names
    a slot (the longest such path, where several do)."""
    out = {}
    for slot in optimizer.variables:
        fits = [v for v in trained if tuple(v.shape) == tuple(slot.shape)
                and slot.name.startswith(v.path.replace("/", "_") + "_")]
        if fits:
            out[id(slot)] = max(fits, key=lambda v: len(v.path))
    return out


def _owners_works() -> bool:
    optimizer = keras.optimizers.Optimizer
    return "_trainable_variables" in _names(optimizer.build) and \
        "_trainable_variables_indices" in _names(optimizer._get_variable_index)


owners = choose("keras.optimizers.Optimizer._trainable_variables", _owners_private,
                _owners_public, _owners_works)
