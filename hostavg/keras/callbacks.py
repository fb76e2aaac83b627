"""Keras callbacks in hostavg's fit: ``keras.callbacks.Callback`` objects, called as ``model.fit`` calls them.

:class:`KerasCallbacks` holds them in Keras's own ``keras.callbacks.CallbackList``
and is one fit-level hook of hostavg's loop (:class:`~hostavg.core.results.Hook`),
so they run beside hostavg's hooks, in ``model.fit``'s order, with Keras's
log names. ``model.stop_training``, set by a callback, ends fit after that
step, the epoch's end still run, as in Keras.

See docs/guides/keras.md for the order of the calls and their logs.
"""

from __future__ import annotations

import keras

from hostavg.compat.keras import initial_epoch
from hostavg.train.history import BOOKKEEPING

__all__ = ["KerasCallbacks", "split_callbacks"]


def split_callbacks(callbacks) -> tuple[list, tuple]:
    """(the ``keras.callbacks.Callback`` objects of ``callbacks``, the others: hostavg hooks).
    One Keras callback alone is taken as a list of it, as Keras's fit takes it."""
    if isinstance(callbacks, keras.callbacks.Callback):
        return [callbacks], ()
    if callbacks is None or not isinstance(callbacks, (list, tuple)):
        return [], callbacks or ()
    keras_ones = [c for c in callbacks if isinstance(c, keras.callbacks.Callback)]
    return keras_ones, tuple(c for c in callbacks if not isinstance(c, keras.callbacks.Callback))


class KerasCallbacks:
    """Keras callbacks as one hostavg fit hook (see the module docstring).

    Args:
      callbacks: the ``keras.callbacks.Callback`` objects, in order.
      model: the model they get (``callback.model``).
      epochs, steps, verbose: fit's parameters, as ``model.fit`` gives them
        (``callback.params``); ``steps`` is None where unknown.
      progbar: add Keras's ``ProgbarLogger`` (its progress bar, as ``verbose``
        says), as ``model.fit`` does unless ``verbose`` is 0.
      validation_logs: a function returning the validation metrics so far (the
        logs of ``on_test_batch_end``).

    Attributes:
      callbacks: Keras's ``CallbackList`` holding them.
    """

    def __init__(self, callbacks, model, *, epochs: int, steps: int | None, verbose,
                 progbar: bool, validation_logs):
        self._last = _LastLogs()  # where Keras's History is in model.fit: before the progbar
        self.callbacks = keras.callbacks.CallbackList(
            [*callbacks, self._last], add_history=False, add_progbar=progbar, model=model,
            verbose=verbose, epochs=epochs, steps=steps)
        self.model, self._validation_logs = model, validation_logs

    def on_train_begin(self) -> int | None:
        self.callbacks.on_train_begin()
        return initial_epoch(self.model) or None  # as Keras: model._initial_epoch or initial_epoch

    def on_epoch_begin(self, epoch: int) -> None:
        self.callbacks.on_epoch_begin(epoch)

    def on_batch_begin(self, batch: int) -> None:
        self.callbacks.on_train_batch_begin(batch)

    def on_batch_end(self, batch: int, logs: dict) -> None:
        self.callbacks.on_train_batch_end(batch, dict(logs))

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        self.callbacks.on_epoch_end(epoch, {k: v for k, v in logs.items() if k not in BOOKKEEPING})
        logs.update(self._last.logs)  # what a callback added ("learning_rate") reaches the History

    def on_train_end(self, history) -> None:
        self.callbacks.on_train_end(self._last.logs)

    def validating(self, chunks):
        """``chunks`` (the validation batches), with ``on_test_begin`` before the first,
        ``on_test_batch_begin``/``_end`` around each; :meth:`validated` ends it."""
        self.callbacks.on_test_begin()
        for i, chunk in enumerate(chunks):
            self.callbacks.on_test_batch_begin(i)
            yield chunk  # evaluated when the evaluation asks for the next chunk
            self.callbacks.on_test_batch_end(i, self._validation_logs())

    def validated(self, logs: dict) -> None:
        self.callbacks.on_test_end(dict(logs))


class _LastLogs(keras.callbacks.Callback):
    """The logs of each epoch as the last callback sees them: with what the others added (the
    list hands every callback one dict)."""

    def __init__(self):
        super().__init__()
        self.logs = None

    def on_epoch_end(self, epoch, logs=None):
        self.logs = logs
