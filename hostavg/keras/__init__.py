"""hostavg for Keras 3 models: ``hostavg.keras.Trainer`` (imports Keras; not imported by ``import hostavg``)."""

from hostavg.keras.trainer import KerasBackend, Trainer, step_together

__all__ = ["KerasBackend", "Trainer", "step_together"]
