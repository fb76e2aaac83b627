"""``hostavg bench --curvature``: what curvature costs on each face.

Per configuration and face (the TF1 ``hostavg`` and ``hostavg-keras``, or on JAX
``hostavg-keras`` alone): the median time of one micro-batch's compute, of one
Hessian-vector product of the same micro-batch (``trainer.hvp``) and their ratio;
and the share of a step's time that :class:`hostavg.hooks.Curvature`
(its defaults) takes at ``every=1`` and ``every=10``, from runs of 10 steps with
and without it, interleaved.
"""

from __future__ import annotations

from hostavg.cli import bench
from hostavg.inspect.curvature import Curvature

__all__ = ["EVERY", "run", "time_curvature"]

#: The hook's periods whose share of a step is measured.
EVERY = (1, 10)
#: Steps per timed run of the step shares: one period of the longest.
STEPS = max(EVERY)


def _make(face: str, config: bench.Config, every: int | None):
    """``face``'s implementation of ``config``, with a Curvature hook of period ``every`` (None: none)."""
    hooks = [] if every is None else [Curvature(every)]
    if face == "hostavg":
        return bench._Hostavg(config, trainer_kw={"hooks": hooks})
    return bench._HostavgKeras(config, hooks=hooks)


def _calls(impl, micro) -> tuple:
    """(one compute, one product) of the first micro-batch of ``micro``, on either face."""
    trainer, arguments = impl.trainer, bench.batch_arguments(impl, *micro[0])
    g = trainer.compute(*arguments)
    return lambda: trainer.compute(*arguments), lambda: trainer.hvp(*arguments, vectors=g)


def time_curvature(config: bench.Config, face: str, repeats: int = 5) -> dict:
    """The compute's and the product's median seconds, and the hook's share of a step per
    period of :data:`EVERY`, for ``face`` on ``config``."""
    micro = bench._batches(config.model, config, 1)[0]
    impls = {every: _make(face, config, every) for every in (None, *EVERY)}
    compute, product = _calls(impls[None], micro)
    product()  # traced and compiled before timing
    calls = bench.median_s({"compute": compute, "product": product}, repeats, inner=5)
    for impl in impls.values():  # the step and the product traced and compiled before timing
        impl.step(micro)
        _calls(impl, micro)[1]()
    steps = bench.median_s({every: lambda i=impl: [i.step(micro) for _ in range(STEPS)]
                       for every, impl in impls.items()}, repeats)
    for impl in impls.values():
        impl.close()
    return {"compute_s": calls["compute"], "product_s": calls["product"],
            "step_s": steps[None] / STEPS,
            "share": {every: 1 - steps[None] / steps[every] for every in EVERY}}


def run(configs, backend: str, repeats: int = 5, out=print) -> list:
    """Times every configuration on every face of ``backend``, prints a table; returns the rows."""
    out(f"{'configuration':<34}{'face':<15}{'compute':>10}{'product':>10}{'ratio':>7}"
        f"{'step':>10}" + "".join(f"{f'every={e}':>10}" for e in EVERY))
    rows = []
    for config in configs:
        for face in bench.faces(backend):
            r = {"config": str(config), "face": face, **time_curvature(config, face, repeats)}
            rows.append(r)
            out(f"{str(config):<34}{face:<15}{r['compute_s'] * 1e3:>8.2f}ms"
                f"{r['product_s'] * 1e3:>8.2f}ms{r['product_s'] / r['compute_s']:>6.1f}x"
                f"{r['step_s'] * 1e3:>8.2f}ms" + "".join(f"{r['share'][e]:>10.0%}" for e in EVERY))
    out(f"(compute, product: one micro-batch's, median of {repeats} samples of 5; step: without "
        f"the hook; every=N: the share of the steps' time that hooks.Curvature(every=N) takes, "
        f"with its defaults, over {STEPS} steps)")
    return rows
