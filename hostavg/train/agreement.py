"""Over MPI, fit's ranks agree before anything trains: the same data and arguments, and rank 0's seed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hostavg.core.errors import StepError

__all__ = ["shared_seed"]


def shared_seed(seed: int | None, settings: dict, gather: Callable | None) -> int:
    """The seed of the data's order: ``seed``, else a fresh one; over MPI (``gather``, the
    trainer's, else None) rank 0's, once every rank's fit ``settings`` (its data's size,
    arguments and position) are the same; else a HostavgError on every rank, before any rank
    trains or returns: no rank may wait for another."""
    seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
    if gather is None:
        return seed
    everyone = gather("the start of fit", (seed, settings))
    differ = [f"{key} " + ", ".join(f"{s[key]!r} on rank {r}" for r, (_, s) in enumerate(everyone))
              for key in settings if len({repr(s[key]) for _, s in everyone}) > 1]
    if differ:
        raise StepError(
            f"the ranks run fit with different data or arguments, so nothing was trained on any: "
            f"{'; '.join(differ)}. fit splits each batch between the ranks: give every rank the "
            f"same data, arguments and checkpoint_dir")
    return everyone[0][0]
