"""Public namespace ``hostavg.hooks``: the names of :mod:`hostavg.train.hooks`."""

from hostavg.train.hooks import *  # noqa: F401,F403
from hostavg.train.hooks import __all__  # noqa: F401
