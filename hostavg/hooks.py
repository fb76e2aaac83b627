"""Public namespace ``hostavg.hooks``: the built-in hooks (:class:`~hostavg.core.results.Hook`).

Steering a step: :class:`SkipNonFinite`, :class:`SkipBadSamples`, :class:`ClipGlobalNorm`,
:class:`ClipMicroBatchNorm`, :class:`WatchOutliers`, :class:`Freeze`
(:mod:`hostavg.train.hooks`). Judging the run: :class:`Diagnose`
(:mod:`hostavg.train.diagnose`). Writing what happened: :class:`Record`
(:mod:`hostavg.inspect.record`) and :class:`TensorBoard` (:mod:`hostavg.inspect.tensorboard`).
Watching it: :class:`LivePlot` (:mod:`hostavg.inspect.live`). Measuring it: :class:`Curvature`
(:mod:`hostavg.inspect.curvature`).
"""

from hostavg.core.results import Drop, Hook, Search
from hostavg.inspect.curvature import Curvature
from hostavg.inspect.live import LivePlot
from hostavg.inspect.record import Record
from hostavg.inspect.tensorboard import TensorBoard
from hostavg.train.diagnose import Diagnose, DiagnosisWarning
from hostavg.train.hooks import (ClipGlobalNorm, ClipMicroBatchNorm, Freeze, OutlierWarning,
                                 SkipBadSamples, SkipNonFinite, WatchOutliers)

__all__ = ["ClipGlobalNorm", "ClipMicroBatchNorm", "Curvature", "Diagnose", "DiagnosisWarning",
           "Drop", "Freeze", "Hook", "LivePlot", "OutlierWarning", "Record", "Search",
           "SkipBadSamples", "SkipNonFinite", "TensorBoard", "WatchOutliers"]
