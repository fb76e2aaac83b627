"""Public namespace ``hostavg.plot``: the names of :mod:`hostavg.inspect.plot`."""

from hostavg.inspect.plot import *  # noqa: F401,F403
from hostavg.inspect.plot import __all__  # noqa: F401
