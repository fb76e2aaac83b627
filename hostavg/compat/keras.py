"""Keras's private APIs that hostavg uses, each detected at import, each with a public fallback.

Imported by :mod:`hostavg.keras` only (it imports Keras). Each wrapper below is
the private form where, when this module is imported, the private API exists
(Keras's own code still reads or writes it), and else its public fallback;
with ``HOSTAVG_PUBLIC_API_ONLY=1`` set before hostavg is imported, every
wrapper is its public fallback (see :mod:`hostavg.compat`). Detection reads
Keras's code objects only: it makes no variable, so it initialises no device.

The wrappers, each with its private API and its public fallback:

* :func:`compile_arguments`: ``Model._compile_config``, the arguments
  ``compile`` was given, as given (the very metric objects); the public
  ``Model.get_compile_config()``, deserialized: equal objects, made anew (a
  metric object the caller holds is then not the one the model updates; a
  custom object must be registered with Keras to be deserialized).
* :func:`initial_epoch`: ``Model._initial_epoch``, the epoch at which Keras's
  ``BackupAndRestore`` callback says training resumes (Keras's own fit reads
  it after ``on_train_begin``); the fallback says None: the backup's weights
  are restored, but training starts at fit's ``initial_epoch``.
"""

from __future__ import annotations

import inspect

import keras

from hostavg.compat import choose

__all__ = ["compile_arguments", "initial_epoch"]


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
