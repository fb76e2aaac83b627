"""Compatibility, until hostavg/__init__.py imports :func:`import_tensorflow` from
:mod:`hostavg.frameworks.tensorflow`; then this module goes (tests/test_layers.py ``WAITING``)."""

from hostavg.frameworks.tensorflow import import_tensorflow

__all__ = ["import_tensorflow"]
