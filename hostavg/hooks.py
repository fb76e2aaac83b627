"""Public namespace ``hostavg.hooks``: the built-in hooks (:class:`~hostavg.core.results.Hook`).

Steering a step: :class:`SkipNonFinite`, :class:`ClipGlobalNorm`,
:class:`ClipMicroBatchNorm`, :class:`WatchOutliers` (:mod:`hostavg.train.hooks`). Writing what
happened: :class:`Record` (:mod:`hostavg.inspect.record`) and
:class:`TensorBoard` (:mod:`hostavg.inspect.tensorboard`). Watching it: :class:`LivePlot`
(:mod:`hostavg.inspect.live`).
"""

from hostavg.core.results import Drop, Hook, Search
from hostavg.inspect.live import LivePlot
from hostavg.inspect.record import Record
from hostavg.inspect.tensorboard import TensorBoard
from hostavg.train.hooks import (ClipGlobalNorm, ClipMicroBatchNorm, OutlierWarning, SkipNonFinite,
                                 WatchOutliers)

__all__ = ["ClipGlobalNorm", "ClipMicroBatchNorm", "Drop", "Hook", "LivePlot", "OutlierWarning",
           "Record", "Search", "SkipNonFinite", "TensorBoard", "WatchOutliers"]
