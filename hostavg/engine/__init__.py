"""The step engine: one optimizer step over k micro-batches, for any framework (NumPy only).

A framework plugs in as a :class:`~hostavg.engine.protocols.Backend`; where the mean is
computed is an :class:`~hostavg.engine.protocols.Average` chosen when a trainer is made.
"""
