"""hostavg's step on a GPU, with Keras on JAX: where a micro-batch's time goes, and the whole step.

    python benchmarks/gpu.py [--sizes gpu|tiny] [--repeats 5] [--json PATH]

Needs JAX (with CUDA, on a GPU) and Keras 3; never imports TensorFlow. For
each model (``--sizes gpu``: the MLPs of ``hostavg bench --grid gpu``, about
2M, 50M and 200M parameters, micro-batches of 64, k = 8; ``tiny``: 50k and
300k parameters, micro-batches of 32, k = 4, to try the script on a CPU) it
measures, each the median of ``--repeats``:

* ``device``: one micro-batch's forward and backward pass on the device
  alone (``jax.value_and_grad`` over ``model.stateless_call``, jitted, as
  Keras's own JAX step takes its gradients), nothing fetched;
* ``compute``: ``trainer.compute`` of one micro-batch: that, plus its
  gradients brought to NumPy the way the trainer does (see
  ``host_memory`` and ``reuses_buffers`` in the output);
* ``d2h_fresh`` and ``d2h_pinned``: the gradients alone brought to the host,
  into new pageable NumPy arrays (``np.asarray``), and by a compiled copy
  into pinned host memory written again each time (donated); with GB/s;
* ``add``: ``Accumulator.add`` of one micro-batch (check and in-place add),
  and NumPy's bare in-place add of as many bytes, with GB/s of memory
  traffic (read two arrays, write one);
* ``h2d``: the mean sent back to the device (``jax.device_put``), GB/s;
  ``apply``: ``trainer.apply`` of a mean (checks, transfer, optimizer);
* the whole step (``hostavg bench``'s interleaved timing): ``hostavg-keras``
  with and without ``overlap``, against ``keras-accum``, Keras's own
  accumulation on the device, and their weights' agreement.

First it measures the bus itself (``pcie``): 256 MiB (``tiny``: 8 MiB) each
way between the device and pageable or pinned host memory; what a
micro-batch's transfer approaches is that pinned figure.

Prints markdown tables and writes every number as JSON. To run on the GPU
machine, where only JAX is installed, carry the keras, namex and optree
wheels (docs/explanation/performance.md says how) and run
``KERAS_BACKEND=jax python3 benchmarks/gpu.py --json $OUT/gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if os.environ.setdefault("KERAS_BACKEND", "jax") != "jax":
    sys.exit(f"benchmarks/gpu.py runs Keras on JAX; KERAS_BACKEND is "
             f"{os.environ['KERAS_BACKEND']!r}")
sys.path.insert(0, str(Path(__file__).parents[1]))  # this checkout's hostavg

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import hostavg  # noqa: E402
import hostavg.keras  # noqa: E402
from hostavg.cli import bench  # noqa: E402

#: --sizes -> (configurations, bytes each way for the bus probe).
SIZES = {"gpu": ([bench.Config(m, 64, 8) for m in ("mlp-2m", "mlp-50m", "mlp-200m")], 2 ** 28),
         "tiny": ([bench.Config(m, 32, 4) for m in ("mlp-50k", "mlp-300k")], 2 ** 23)}
GB = 1e9


def timed(function, repeats: int) -> float:
    """The median seconds of ``repeats`` calls of ``function`` (after one call not timed)."""
    function()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        function()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pinned():
    """The default device's pinned host memory, or None where it has none."""
    device = jax.devices()[0]
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


class ToPinned:
    """A compiled copy of device arrays into pinned host memory, writing the same buffers each
    time (the previous copy is donated once nothing else holds it)."""

    def __init__(self, arrays, sharding):
        self.sharding = sharding
        self.copy = jax.jit(lambda a, buffers: a, donate_argnums=1, keep_unused=True,
                            out_shardings=[sharding] * len(arrays))
        self.buffers = [jax.device_put(jnp.zeros(a.shape, a.dtype), sharding) for a in arrays]

    def __call__(self, arrays):
        self.buffers = self.copy(arrays, self.buffers)
        jax.block_until_ready(self.buffers)
        return self.buffers


def bus(nbytes: int, repeats: int) -> dict:
    """GB/s each way between the device and pageable or pinned host memory, ``nbytes`` at a time."""
    x = jax.device_put(np.ones(nbytes // 4, np.float32))
    host = np.ones(nbytes // 4, np.float32)
    out = {"bytes": nbytes}

    def d2h_fresh():
        fresh = x + 0  # a new device array: no host copy of it cached yet
        fresh.block_until_ready()
        t0 = time.perf_counter()
        np.asarray(fresh)
        return time.perf_counter() - t0

    out["d2h_pageable_gbs"] = nbytes / GB / statistics.median(d2h_fresh() for _ in range(repeats + 1))
    out["h2d_pageable_gbs"] = nbytes / GB / timed(
        lambda: jax.device_put(host).block_until_ready(), repeats)
    pinned = _pinned()
    if pinned is not None:
        to_pinned = ToPinned([x], pinned)
        out["d2h_pinned_gbs"] = nbytes / GB / timed(lambda: to_pinned([x]), repeats)
        on_host = to_pinned([x])[0]
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        out["h2d_pinned_gbs"] = nbytes / GB / timed(
            lambda: jax.device_put(on_host, device).block_until_ready(), repeats)
    return out


def device_gradient(model, loss):
    """A jitted (trainable, non-trainable, x, y) -> gradients of ``model``, as Keras's own JAX
    step takes them; nothing leaves the device."""
    def of(trainable, untrained, x, y):
        y_pred, untrained = model.stateless_call(trainable, untrained, x, training=True)
        return loss(y, y_pred), untrained

    grad = jax.jit(jax.grad(of, has_aux=True))
    return lambda x, y: grad([v.value for v in model.trainable_variables],
                             [v.value for v in model.non_trainable_variables], x, y)


def parts(config: bench.Config, repeats: int) -> dict:
    """Where one micro-batch's time goes, for ``config``'s model (see the module docstring)."""
    model = bench._build(config.model, keras=True)
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.Adam(1e-3, epsilon=1e-8))
    micro = bench._batches(config.model, config, 1)[0]
    x, y = micro[0]
    backend = trainer._backend  # noqa: SLF001 - a benchmark reads where the gradients land
    out = {"config": str(config), "parameters": model.count_params()}
    out["compute_s"] = timed(lambda: trainer.compute(x, y), repeats)
    nbytes = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in trainer.spec.values())
    out.update(gradient_bytes=nbytes, host_memory=backend.host_memory,
               reuses_buffers=backend.reuses_buffers)

    grad = device_gradient(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    xd, yd = jax.device_put(x), jax.device_put(y)
    out["device_s"] = timed(lambda: jax.block_until_ready(grad(xd, yd)), repeats)
    grads, _ = grad(xd, yd)
    jax.block_until_ready(grads)

    def d2h_fresh():
        fresh = [g + 0 for g in grads]
        jax.block_until_ready(fresh)
        t0 = time.perf_counter()
        for g in fresh:
            np.asarray(g)
        return time.perf_counter() - t0

    out["d2h_fresh_s"] = statistics.median(d2h_fresh() for _ in range(repeats + 1))
    pinned = _pinned()
    if pinned is not None:
        to_pinned = ToPinned(grads, pinned)
        out["d2h_pinned_s"] = timed(lambda: to_pinned(grads), repeats)

    gradients = [trainer.compute(x, y) for _ in range(2)]
    acc = trainer.accumulator()

    def add():
        acc.reset()
        for g in gradients:
            acc.add(g)

    out["add_s"] = timed(add, repeats) / 2
    a = np.ones(nbytes // 4, np.float32)
    b = np.ones(nbytes // 4, np.float32)
    out["numpy_add_s"] = timed(lambda: np.add(a, b, out=a), repeats)
    mean = acc.mean()
    out["h2d_s"] = timed(lambda: jax.block_until_ready(
        [jax.device_put(np.asarray(v)) for v in mean.values()]), repeats)
    out["apply_s"] = timed(lambda: trainer.apply(mean), repeats)
    for key in ("d2h_fresh", "d2h_pinned", "h2d"):
        if f"{key}_s" in out:
            out[f"{key}_gbs"] = nbytes / GB / out[f"{key}_s"]
    out["add_gbs"] = 3 * nbytes / GB / out["add_s"]
    out["numpy_add_gbs"] = 3 * nbytes / GB / out["numpy_add_s"]
    return out


def _ms(seconds) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}" if seconds < 0.01 else \
        f"{seconds * 1e3:.1f}"


def _gbs(value) -> str:
    return "" if value is None else f"{value:.1f}"


def tables(results: dict) -> str:
    """The results as markdown tables."""
    b = results["bus"]
    lines = [f"Bus, {b['bytes'] / 2 ** 20:.0f} MiB each way (GB/s): device to pageable host "
             f"{_gbs(b['d2h_pageable_gbs'])}, to pinned host {_gbs(b.get('d2h_pinned_gbs'))}; "
             f"pageable host to device {_gbs(b['h2d_pageable_gbs'])}, pinned "
             f"{_gbs(b.get('h2d_pinned_gbs'))}.", "",
             "One micro-batch (ms; GB/s in parentheses):", "",
             "| model | parameters | device | compute | to host, new arrays | to host, pinned "
             "| add | NumPy add | to device | apply | gradients land in |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for p in results["parts"]:
        lands = p["host_memory"] + (", reused" if p["reuses_buffers"] else ", new each time")
        lines.append(
            f"| {p['config']} | {p['parameters']:,} | {_ms(p['device_s'])} | {_ms(p['compute_s'])} "
            f"| {_ms(p['d2h_fresh_s'])} ({_gbs(p['d2h_fresh_gbs'])}) "
            f"| {_ms(p.get('d2h_pinned_s'))} ({_gbs(p.get('d2h_pinned_gbs'))}) "
            f"| {_ms(p['add_s'])} ({_gbs(p['add_gbs'])}) "
            f"| {_ms(p['numpy_add_s'])} ({_gbs(p['numpy_add_gbs'])}) "
            f"| {_ms(p['h2d_s'])} ({_gbs(p['h2d_gbs'])}) | {_ms(p['apply_s'])} | {lands} |")
    names = list(results["steps"][0]["median_s"])
    lines += ["", "The whole step (ms; in parentheses the ratio to keras-accum):", "",
              "| model | k | " + " | ".join(names) + " | largest weight difference |",
              "|---|--:|" + "--:|" * len(names) + "--:|"]
    for s in results["steps"]:
        t = s["median_s"]
        lines.append(f"| {s['config']} | {s['k']} | "
                     + " | ".join(f"{_ms(t[n])} ({t[n] / t['keras-accum']:.2f})" for n in names)
                     + f" | {max(s['max_weight_diff'].values()):.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", choices=SIZES, default="gpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args(argv)
    configs, bus_bytes = SIZES[args.sizes]
    device = jax.devices()[0]
    results = {"machine": {"device": str(device), "platform": device.platform,
                           "device_kind": device.device_kind, "cpus": os.cpu_count(),
                           "python": platform.python_version(), "jax": jax.__version__,
                           "keras": keras.__version__, "numpy": np.__version__},
               "sizes": args.sizes, "repeats": args.repeats}
    print(f"# {device.device_kind} ({device.platform}), JAX {jax.__version__}, Keras "
          f"{keras.__version__}, {os.cpu_count()} CPUs", flush=True)

    def keep():  # after each stage: a run cut short keeps what it measured
        results["tensorflow_imported"] = "tensorflow" in sys.modules
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")

    results["bus"] = bus(bus_bytes, args.repeats)
    print(f"# bus: {results['bus']}", flush=True)
    results["parts"], results["steps"] = [], []
    keep()
    for config in configs:
        print(f"# {config}: parts", flush=True)
        results["parts"].append(parts(config, args.repeats))
        keep()
        print(f"# {config}: whole steps", flush=True)
        step = bench.time_config(config, bench.GPU_IMPLEMENTATIONS, repeats=args.repeats)
        results["steps"].append({"config": str(config), "k": config.k, **step})
        keep()
    print(tables(results))
    print(f"TensorFlow imported: {results['tensorflow_imported']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
