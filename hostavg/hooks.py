"""Public namespace ``hostavg.hooks``: the built-in hooks (:class:`~hostavg.core.results.Hook`).

Steering a step: :class:`SkipNonFinite`, :class:`ClipGlobalNorm`,
:class:`ClipMicroBatchNorm` (:mod:`hostavg.train.hooks`). Writing what
happened: :class:`Record` (:mod:`hostavg.inspect.record`) and
:class:`TensorBoard` (:mod:`hostavg.inspect.tensorboard`). Watching it: :class:`LivePlot`
(:mod:`hostavg.inspect.live`). Measuring it: :class:`Curvature` (:mod:`hostavg.inspect.curvature`).
"""

from hostavg.core.results import Drop, Hook
from hostavg.inspect.curvature import Curvature
from hostavg.inspect.live import LivePlot
from hostavg.inspect.record import Record
from hostavg.inspect.tensorboard import TensorBoard
from hostavg.train.hooks import ClipGlobalNorm, ClipMicroBatchNorm, SkipNonFinite

__all__ = ["ClipGlobalNorm", "ClipMicroBatchNorm", "Curvature", "Drop", "Hook", "LivePlot", "Record", "SkipNonFinite",
           "TensorBoard"]
