"""hostavg for Keras 3 models: ``hostavg.keras.Trainer`` (imports Keras; not imported by ``import hostavg``).

The face is :mod:`hostavg.keras.trainer`; what every Keras backend shares is
:mod:`hostavg.keras.common`; Keras's TensorFlow backend is
:mod:`hostavg.keras.tensorflow`.
"""

from hostavg.keras.tensorflow import KerasBackend
from hostavg.keras.trainer import Trainer, step_together

__all__ = ["KerasBackend", "Trainer", "step_together"]
