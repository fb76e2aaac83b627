"""Keras's private APIs that hostavg uses, each detected at import, each with a public fallback.

Imported by :mod:`hostavg.keras` only. Each wrapper is the private form where
the private API exists (Keras's own code still reads or writes it), else its
public fallback; ``HOSTAVG_PUBLIC_API_ONLY=1`` makes it the fallback (see
:mod:`hostavg.compat`). Detection reads Keras's code objects only: it makes
no variable, so it initialises no device. Each, private API; fallback:

* :func:`compile_arguments`: ``Model._compile_config``, the arguments
  ``compile`` was given, as given (the very metric objects); the public
  ``Model.get_compile_config()``, deserialized: equal objects, made anew (a
  metric object the caller holds is then not the one the model updates; a
  custom object must be registered with Keras to be deserialized).
* :func:`initial_epoch`: ``Model._initial_epoch``, the epoch at which Keras's
  ``BackupAndRestore`` callback says training resumes (Keras's own fit reads
  it after ``on_train_begin``); the fallback says None: the backup's weights
  are restored, but training starts at fit's ``initial_epoch``.
* :func:`unbuilt`: ``Model._symbolic_build``'s test (a layer, the compiled
  loss or metrics not built); the fallback sees no unbuilt compiled loss.
"""

from __future__ import annotations

import inspect

import keras

from hostavg.compat import choose

__all__ = ["compile_arguments", "initial_epoch", "unbuilt"]


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
