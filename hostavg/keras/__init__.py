"""hostavg for Keras 3 models: ``hostavg.keras.Trainer`` (imports Keras; not imported by ``import hostavg``).

The face is :mod:`hostavg.keras.trainer`; what every Keras backend shares is
:mod:`hostavg.keras.common` (the compiled model, batches, metrics),
:mod:`hostavg.keras.data` (what fit takes as data),
:mod:`hostavg.keras.callbacks` (Keras callbacks in fit) and
:mod:`hostavg.keras.train_step` (a model's own train_step); Keras's TensorFlow
backend is :mod:`hostavg.keras.tensorflow`, its JAX backend
:mod:`hostavg.keras.jax`. The trainer uses the one Keras runs on
(``keras.backend.backend()``); each backend module is imported when first
used, so on JAX TensorFlow is never imported.
"""

import importlib

from hostavg.keras.trainer import Trainer, step_together

# Public names whose module imports a framework: name -> module.
_LAZY = {"KerasBackend": "hostavg.keras.tensorflow", "KerasJaxBackend": "hostavg.keras.jax"}

__all__ = ["KerasBackend", "KerasJaxBackend", "Trainer", "step_together"]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hostavg.keras' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
