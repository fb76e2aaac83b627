"""fit's callbacks: their base class, early stopping, and the exception that ends fit cleanly."""

from __future__ import annotations

from hostavg.core.errors import ArgumentError, StepError, non_negative_int, non_negative_number

__all__ = ["Callback", "EarlyStopping", "StopTraining"]

MODES = ("min", "max")


class StopTraining(Exception):
    """Raise from a callback to end fit cleanly after the current step or epoch.

    The message is recorded as ``History.stopped``. fit writes its final
    checkpoint and calls every ``on_train_end``; a fit started again from
    that checkpoint directory does not train further.
    """


class Callback:
    """A base for hooks and callbacks, with no methods of its own.

    A subclass defines the methods it needs of the one hook protocol,
    :class:`~hostavg.hooks.Hook` (any object with some of them serves as well);
    fit looks each method up once, when it starts, and a missing one costs nothing.
    """


class EarlyStopping(Callback):
    """Stops fit when ``logs[monitor]`` has not improved for ``patience`` epochs.

    Improvement means below the best by more than ``min_delta`` (``mode="min"``)
    or above it (``mode="max"``).

    Attributes:
      best: the best value seen; ``best_epoch`` its epoch.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 2, min_delta: float = 0.0,
                 mode: str = "min"):
        if mode not in MODES:
            raise ArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        self.monitor, self.patience = monitor, non_negative_int("patience", patience)
        self.min_delta = non_negative_number("min_delta", min_delta)
        self._sign = 1.0 if mode == "min" else -1.0
        self.best, self.best_epoch = None, None

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        if self.monitor not in logs:
            raise StepError(
                f"EarlyStopping monitors {self.monitor!r}, which the epoch logs lack; they "
                f"hold {sorted(logs)} (val_* need validation_data)")
        value = logs[self.monitor]
        if self.best is None or self._sign * (self.best - value) > self.min_delta:
            self.best, self.best_epoch = value, epoch
        elif epoch - self.best_epoch >= self.patience:
            raise StopTraining(
                f"early stopping: {self.monitor} has not improved on {self.best:.6g} "
                f"(epoch {self.best_epoch}) for {self.patience} epochs")
