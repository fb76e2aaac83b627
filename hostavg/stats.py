"""Public namespace ``hostavg.stats``: the names of :mod:`hostavg.core.stats`."""

from hostavg.core.stats import *  # noqa: F401,F403
from hostavg.core.stats import __all__  # noqa: F401
