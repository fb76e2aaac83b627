"""What more than one part of hostavg needs of a framework, one module per framework.

:mod:`hostavg.frameworks.tensorflow` serves both TensorFlow backends
(:mod:`hostavg.tf1` and Keras's :mod:`hostavg.keras.tensorflow`) and the command
line, so that neither backend imports the other. Public framework APIs only (the
private ones are wrapped in :mod:`hostavg.compat`); importing a module here
imports no framework. The framework-free layers (core, engine, train, inspect)
never import this package (``tests/test_layers.py``).
"""
