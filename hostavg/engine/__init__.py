"""The step engine: one optimizer step over k micro-batches, for any framework (NumPy only).

A framework plugs in as a :class:`~hostavg.engine.step.Backend`; where the mean is
computed is an :class:`~hostavg.engine.step.Average` chosen when a trainer is made.
"""
