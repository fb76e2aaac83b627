"""``hostavg bench``: hostavg's step time and host memory side by side with the alternatives.

Every implementation trains the same model from the same initial weights on
the same micro-batches, in one process, interleaved (each repeat times one
step of every implementation, in a rotating order), and reports the median
step time. Implementations:

* ``hostavg``: the defaults (accumulate="sum", average="host");
* ``hostavg-stack``: accumulate="stack"; ``hostavg-graph``: average="graph";
* ``hostavg-stack+stats``: accumulate="stack", reading every statistic each
  step (the stack-only ones are computed when read, so ``hostavg-stack`` is
  the same with them off). In "sum" mode the statistics come from the squared
  norms that also serve as the NaN check, so there is nothing to switch off;
* ``in-graph``: non-trainable accumulator variables updated with
  ``assign_add`` (``scatter_add`` for sparse gradients) per micro-batch, with
  nothing fetched, then one run that applies their weighted mean and zeroes
  them: the usual in-graph accumulation;
* ``plain-host``: the recipe people write by hand: ``sess.run`` of the
  gradient list per micro-batch, ``np.stack`` per variable, a ``reduce_mean``
  placeholder graph, then ``sess.run(train_op, feed_dict=...)`` through the
  gradient tensors (sparse gradients are fetched dense);
* ``full-batch``: one ``minimize`` step on the concatenated batch, no
  accumulation: the compute floor, where memory allows;
* ``hostavg-keras``: the same model as a Keras 3 model (same layers and
  initial weights, :mod:`hostavg.models`), trained by ``hostavg.keras.Trainer``
  with its defaults;
* ``keras-accum``: that Keras model compiled with Keras 3's own accumulation,
  ``Adam(..., gradient_accumulation_steps=k)``, one ``train_on_batch`` per
  micro-batch: Keras's answer to the same problem.

Both Keras implementations use ``keras.optimizers.Adam(1e-3, epsilon=1e-8)``,
the update of ``tf.compat.v1.train.AdamOptimizer(1e-3)``, so every
implementation ends with the same weights.

Peak host memory is measured per implementation in a fresh process (the peak
resident set size during a few steps, above what it was before them), since a
process's allocators keep what earlier implementations freed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["CONFIG_MODELS", "DEFAULT_IMPLEMENTATIONS", "IMPLEMENTATIONS", "Config", "measure_memory",
           "run", "time_config"]

IMPLEMENTATIONS = ("hostavg", "hostavg-stack", "hostavg-graph", "in-graph", "plain-host",
                   "full-batch", "hostavg-keras", "keras-accum", "hostavg-stack+stats")
#: What ``hostavg bench`` runs unless told otherwise (``--stats`` adds the last one).
DEFAULT_IMPLEMENTATIONS = IMPLEMENTATIONS[:-1]

#: name -> (builder keyword arguments, description)
CONFIG_MODELS = {
    "mlp-50k": ("mlp", {"features": 784, "hidden": [64], "classes": 10}),
    "mlp-300k": ("mlp", {"features": 784, "hidden": [384], "classes": 10}),
    "mlp-2m": ("mlp", {"features": 784, "hidden": [1024, 1024], "classes": 10}),
    "conv": ("convnet", {"side": 28, "channels": [16, 32], "classes": 10}),
    "embedding": ("embedding", {"vocab": 100_000, "dim": 32, "length": 16, "classes": 10}),
}


@dataclass(frozen=True)
class Config:
    """One cell of the grid: a model, a micro-batch size and a number of micro-batches."""

    model: str
    micro_batch_size: int
    k: int

    def __str__(self):
        return f"{self.model} micro={self.micro_batch_size} k={self.k}"


def _build(model: str, seed: int = 0, keras: bool = False):
    from hostavg import models
    builder, kwargs = CONFIG_MODELS[model]
    return getattr(models, f"keras_{builder}" if keras else builder)(**kwargs, seed=seed)


def _batches(model: str, config: Config, steps: int, seed: int = 0):
    """``steps`` lists of k (x, y) micro-batches for ``model``'s input."""
    builder, kwargs = CONFIG_MODELS[model]
    if builder == "embedding":
        shape = (kwargs["length"],)
    elif builder == "convnet":
        shape = (kwargs["side"] ** 2,)
    else:
        shape = (kwargs["features"],)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(config.k):
            n = config.micro_batch_size
            if builder == "embedding":
                x = rng.integers(0, kwargs["vocab"], (n, *shape)).astype(np.int32)
            else:
                x = rng.random((n, *shape), dtype=np.float32)
            micro.append((x, rng.integers(0, 10, n).astype(np.int32)))
        out.append(micro)
    return out


def _optimizer():
    import tensorflow as tf
    return tf.compat.v1.train.AdamOptimizer(1e-3)


def _keras_optimizer(**kwargs):
    import keras
    return keras.optimizers.Adam(1e-3, epsilon=1e-8, **kwargs)


class _Impl:
    """One implementation of an optimizer step over k micro-batches, in its own graph and session."""

    def __init__(self, model_name: str, session_config=None):
        import tensorflow as tf
        self.tf, self.v1 = tf, tf.compat.v1
        self.model = _build(model_name)
        with self.model.graph.as_default():
            self._build()
            init = self.v1.global_variables_initializer()
        self.sess = self.v1.Session(graph=self.model.graph, config=session_config)
        self.sess.run(init)

    @property
    def parameters(self) -> int:
        return self.model.parameters

    def weights(self) -> list:
        with self.model.graph.as_default():
            return self.sess.run(self.v1.trainable_variables())

    def feed(self, x, y) -> dict:
        return {self.model.x: x, self.model.y: y}

    def close(self) -> None:
        self.sess.close()


class _Hostavg(_Impl):
    def __init__(self, model_name, accumulate="sum", average="host", read_stats=False, **kw):
        self.accumulate, self.average, self.read_stats = accumulate, average, read_stats
        super().__init__(model_name, **kw)

    def _build(self):
        from hostavg.trainer import Trainer
        self.trainer = Trainer(self.model.loss, _optimizer(), accumulate=self.accumulate,
                               average=self.average)

    def step(self, micro):
        result = self.trainer.step(self.sess, [self.feed(x, y) for x, y in micro])
        if self.read_stats:
            st = result.stats
            (st.inner_product_test, st.orthogonality_test, st.gsnr, st.cosines)


class _InGraph(_Impl):
    def _build(self):
        tf, v1 = self.tf, self.v1
        opt = _optimizer()
        pairs = [(g, v) for g, v in opt.compute_gradients(self.model.loss) if g is not None]
        self.n = v1.placeholder(tf.float32, ())
        with tf.name_scope("in_graph_accumulators"):
            accs = [tf.Variable(tf.zeros(v.shape, v.dtype.base_dtype), trainable=False)
                    for _, v in pairs]
            total = tf.Variable(0.0, trainable=False)
        adds = [total.assign_add(self.n)]
        for (g, _), acc in zip(pairs, accs):
            if isinstance(g, tf.IndexedSlices):
                adds.append(acc.scatter_add(tf.IndexedSlices(g.values * self.n, g.indices)))
            else:
                adds.append(acc.assign_add(g * self.n))
        self.accumulate = tf.group(*adds)
        apply = opt.apply_gradients([(acc / total, v) for acc, (_, v) in zip(accs, pairs)])
        with tf.control_dependencies([apply]):
            self.apply = tf.group(*[acc.assign(tf.zeros_like(acc)) for acc in accs],
                                  total.assign(0.0))

    def step(self, micro):
        for x, y in micro:
            self.sess.run(self.accumulate, {**self.feed(x, y), self.n: len(x)})
        self.sess.run(self.apply)


class _PlainHost(_Impl):
    def _build(self):
        tf, v1 = self.tf, self.v1
        opt = _optimizer()
        pairs = [(tf.convert_to_tensor(g), v) for g, v in opt.compute_gradients(self.model.loss)
                 if g is not None]
        self.grads = [g for g, _ in pairs]
        self.train = opt.apply_gradients(pairs)
        self.stacked = [v1.placeholder(g.dtype, [None, *g.shape]) for g in self.grads]
        self.means = [tf.reduce_mean(s, axis=0) for s in self.stacked]

    def step(self, micro):
        fetched = [self.sess.run(self.grads, self.feed(x, y)) for x, y in micro]
        stacks = [np.stack([f[j] for f in fetched]) for j in range(len(self.grads))]
        means = self.sess.run(self.means, dict(zip(self.stacked, stacks)))
        self.sess.run(self.train, dict(zip(self.grads, means)))


class _FullBatch(_Impl):
    def _build(self):
        self.train = _optimizer().minimize(self.model.loss)

    def step(self, micro):
        self.sess.run(self.train, self.feed(np.concatenate([x for x, _ in micro]),
                                            np.concatenate([y for _, y in micro])))


class _KerasImpl:
    """One implementation on the Keras twin of the model."""

    def __init__(self, model_name: str):
        self.model = _build(model_name, keras=True)

    @property
    def parameters(self) -> int:
        return self.model.count_params()

    def weights(self) -> list:
        return [v.numpy() for v in self.model.trainable_variables]

    def close(self) -> None:
        pass


class _HostavgKeras(_KerasImpl):
    def __init__(self, model_name):
        super().__init__(model_name)
        from hostavg import models
        from hostavg.keras import Trainer
        self.trainer = Trainer(self.model, models.keras_loss(), _keras_optimizer())

    def step(self, micro):
        self.trainer.step(micro)


class _KerasAccumulation(_KerasImpl):
    def __init__(self, model_name, k: int):
        super().__init__(model_name)
        from hostavg import models
        self.model.compile(optimizer=_keras_optimizer(gradient_accumulation_steps=k),
                           loss=models.keras_loss())

    def step(self, micro):
        for x, y in micro:
            self.model.train_on_batch(x, y)


def _make(name: str, config: Config, session_config=None):
    kw, model_name = {"session_config": session_config}, config.model
    return {"hostavg": lambda: _Hostavg(model_name, **kw),
            "hostavg-stack": lambda: _Hostavg(model_name, accumulate="stack", **kw),
            "hostavg-stack+stats": lambda: _Hostavg(model_name, accumulate="stack",
                                                    read_stats=True, **kw),
            "hostavg-graph": lambda: _Hostavg(model_name, average="graph", **kw),
            "in-graph": lambda: _InGraph(model_name, **kw),
            "plain-host": lambda: _PlainHost(model_name, **kw),
            "full-batch": lambda: _FullBatch(model_name, **kw),
            "hostavg-keras": lambda: _HostavgKeras(model_name),
            "keras-accum": lambda: _KerasAccumulation(model_name, config.k)}[name]()


def time_config(config: Config, implementations=DEFAULT_IMPLEMENTATIONS, repeats: int = 7,
                warmup: int = 1) -> dict:
    """Median step seconds per implementation, timed interleaved; also their weights' agreement."""
    impls = {name: _make(name, config) for name in implementations}
    data = _batches(config.model, config, warmup + repeats)
    times = {name: [] for name in impls}
    names = list(impls)
    for r, micro in enumerate(data):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            impls[name].step(micro)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    weights = {name: impl.weights() for name, impl in impls.items()}
    reference = weights[names[0]]
    diff = {name: max(float(np.max(np.abs(a - b))) for a, b in zip(w, reference))
            for name, w in weights.items()}
    for impl in impls.values():
        impl.close()
    return {"median_s": {n: statistics.median(t) for n, t in times.items()},
            "iqr_s": {n: _iqr(t) for n, t in times.items()},
            "max_weight_diff": diff, "parameters": impls[names[0]].parameters}


def _iqr(values: list) -> float:
    """The interquartile range (0 for a single value)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def measure_memory(config: Config, implementation: str, steps: int = 3) -> int:
    """Peak resident memory added by ``steps`` steps of one implementation, in a fresh process (bytes)."""
    code = ("import json, sys; from hostavg.bench import _memory_probe, Config; "
            f"print(json.dumps(_memory_probe(Config({config.model!r}, {config.micro_batch_size}, "
            f"{config.k}), {implementation!r}, {steps})))")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode:
        raise RuntimeError(f"memory probe for {implementation} on {config} failed:\n{out.stderr}")
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def _memory_probe(config: Config, implementation: str, steps: int) -> int:
    impl = _make(implementation, config)
    data = _batches(config.model, config, steps + 1)
    # One step of a single micro-batch first: kernels, caches and one gradient's buffers
    # are allocated then, and a step of k micro-batches cannot hide in memory it freed.
    impl.step(data[0][:1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size to the current one
    before = _status_kb("VmRSS")
    for micro in data[1:]:
        impl.step(micro)
    return (_status_kb("VmHWM") - before) * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def grid(name: str) -> list[Config]:
    """The configurations of grid ``"quick"`` (the default), ``"full"`` or ``"smallest"``.

    smallest: mlp-50k, micro-batches of 32, k = 4 (a smoke test); quick: every
    model at micro-batch size 32 with k = 4 and 8; full: micro-batch sizes 32
    and 128 with k = 4, 8 and 32.
    """
    if name == "smallest":
        return [Config("mlp-50k", 32, 4)]
    if name == "quick":
        return [Config(m, 32, k) for m in CONFIG_MODELS for k in (4, 8)]
    return [Config(m, micro, k) for m in CONFIG_MODELS for micro in (32, 128) for k in (4, 8, 32)]


def run(configs, implementations=DEFAULT_IMPLEMENTATIONS, repeats: int = 7, memory: bool = True,
        memory_config: Config = Config("mlp-2m", 32, 8), out=print, progress=None) -> dict:
    """Times every configuration, measures memory, prints tables; returns the JSON-ready results.

    ``progress``: a stream for one line per configuration and memory probe
    as it starts (default standard error; False for none).
    """
    say = _progress(progress)
    results = {"machine": _machine(), "repeats": repeats, "configs": []}
    widths = [max(len(n), 19) + 2 for n in implementations]
    out(f"{'configuration':<28}{'params':>10}" + "".join(f"{n:>{w}}" for n, w in
                                                          zip(implementations, widths)))
    for i, config in enumerate(configs):
        say(f"timing {config} ({i + 1} of {len(configs)}): {repeats} steps of each of "
            f"{len(implementations)} implementations")
        r = time_config(config, implementations, repeats)
        base = r["median_s"].get("in-graph")
        r["ratio_to_in_graph"] = {n: t / base for n, t in r["median_s"].items()} if base else {}
        results["configs"].append({"model": config.model, "micro_batch_size": config.micro_batch_size,
                                   "k": config.k, **r})
        cells = "".join(f"{_cell(r['median_s'][n], r['iqr_s'][n], base):>{w}}"
                        for n, w in zip(implementations, widths))
        out(f"{str(config):<28}{r['parameters']:>10,}{cells}")
    out("(each cell: median step time, its interquartile range in parentheses"
        + (", and its ratio to in-graph accumulation)" if "in-graph" in implementations else ")"))
    if {"hostavg-keras", "keras-accum"} <= set(implementations):
        out("\nKeras 3's own accumulation over hostavg's Keras engine (keras-accum / hostavg-keras):")
        for c in results["configs"]:
            t = c["median_s"]
            c["keras_accum_over_hostavg_keras"] = t["keras-accum"] / t["hostavg-keras"]
            out(f"  {str(Config(c['model'], c['micro_batch_size'], c['k'])):<28}"
                f"{c['keras_accum_over_hostavg_keras']:.2f}x")
    if memory:
        results["memory"] = _memory_tables(implementations, memory_config, out, say)
    return results


def _progress(stream):
    if stream is False:
        return lambda line: None
    return lambda line: print(f"bench: {line}", file=stream or sys.stderr, flush=True)


def _cell(seconds: float, iqr: float, base: float | None) -> str:
    return f"{seconds * 1e3:.1f}ms ({iqr * 1e3:.1f})" + (f" {seconds / base:.2f}" if base else "")


def _memory_tables(implementations, config: Config, out, say) -> dict:
    mib = 2 ** 20
    per_impl = {}
    for n in implementations:
        say(f"measuring memory: {n} on {config}, in a fresh process")
        per_impl[n] = measure_memory(config, n)
    out(f"\npeak extra host memory per step, {config}:")
    for n, b in per_impl.items():
        out(f"  {n:<22}{b / mib:8.1f} MiB")
    scaling = {}
    for n in ("hostavg", "hostavg-stack"):
        if n in implementations:
            say(f"measuring memory: {n} at k = 4 and 64")
            scaling[n] = {k: measure_memory(Config(config.model, config.micro_batch_size, k), n)
                          for k in (4, 64)}
            out(f"  {n:<22}k=4: {scaling[n][4] / mib:.1f} MiB, k=64: {scaling[n][64] / mib:.1f} MiB")
    return {"config": str(config), "peak_bytes": per_impl, "k_scaling": scaling}


def _machine() -> dict:
    import platform
    return {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version()}
