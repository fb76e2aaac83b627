"""hostavg: large-batch training on one small device, with every micro-batch's gradient on the host.

Per optimizer step, each micro-batch's gradients are fetched to NumPy, summed
or stacked and averaged on the host (sample-weighted), and the mean is applied
once: the step equals the full-batch step, and every gradient can be looked at.

One trainer contract (:class:`hostavg.train.trainer.BaseTrainer`), two faces
that differ only in how data is given: :class:`Trainer` for ``tf.compat.v1``
graphs (a session and feed dicts) and ``hostavg.keras.Trainer`` for Keras 3
models (``x, y, sample_weight``), after ``import hostavg.keras``. TensorFlow is
imported the first time a name that needs it is used, so ``import hostavg``
stays fast. The documentation's architecture page shows the layers.

A few private APIs of CPython, TensorFlow, Keras and JAX serve the fast paths,
each detected on import with a public fallback (:mod:`hostavg.compat` says
where a fallback's results differ): :func:`private_apis` names those in use;
``HOSTAVG_PUBLIC_API_ONLY=1`` before importing hostavg uses the fallbacks only.
"""

import importlib

from hostavg.compat import private_apis
from hostavg.core.accumulator import ACCUMULATE_MODES, Accumulator
from hostavg.core.curvature import Curvature
from hostavg.train.callbacks import Callback, EarlyStopping, StopTraining
from hostavg.engine.protocols import AVERAGE_MODES
from hostavg.core.errors import ArgumentError, HostavgError, StepError
from hostavg.core.gradients import Gradients, SparseGradient, VariableSpec
from hostavg.train.history import History, StepLog
from hostavg.train.loop import ResumeWarning
from hostavg.train.diagnose import DiagnosisWarning
from hostavg.train.hooks import OutlierWarning
from hostavg.inspect.record import load_record
from hostavg.core.results import MicroBatch, StepResult
from hostavg.core.split import split
from hostavg.core.stats import NoiseScale, StepStats

__version__ = "0.2.0"

# Public names whose module imports TensorFlow (or matplotlib): name -> module.
_LAZY = {
    "Trainer": "hostavg.tf1.trainer",
    "step_together": "hostavg.tf1.trainer",
    "import_tensorflow": "hostavg.compat.tensorflow",
}
_SUBMODULES = ("hooks", "plot", "stats")

__all__ = [
    "ACCUMULATE_MODES",
    "AVERAGE_MODES",
    "Accumulator",
    "ArgumentError",
    "Callback",
    "Curvature",
    "DiagnosisWarning",
    "EarlyStopping",
    "Gradients",
    "History",
    "HostavgError",
    "MicroBatch",
    "NoiseScale",
    "OutlierWarning",
    "ResumeWarning",
    "SparseGradient",
    "StepLog",
    "StepError",
    "StepResult",
    "StepStats",
    "StopTraining",
    "Trainer",
    "VariableSpec",
    "hooks",
    "import_tensorflow",
    "load_record",
    "plot",
    "private_apis",
    "split",
    "stats",
    "step_together",
    "__version__",
]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"hostavg.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hostavg' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
