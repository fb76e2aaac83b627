"""``hostavg bench``: hostavg's step time and host memory side by side with the alternatives.

Every implementation (:data:`IMPLEMENTATIONS`: the hostavg variants,
``in-graph`` accumulation, the hand-written ``plain-host`` recipe,
``full-batch``, and the Keras ones) trains the same model from the same
initial weights on the same micro-batches, in one process, interleaved, with
the configuration's optimizer (:data:`OPTIMIZERS`), and reports the median
step time and its ratio to the configuration's baseline (``full-batch`` at
k = 1, else ``in-graph``, else ``keras-accum``). Peak host memory is
measured per implementation in a fresh process.

See docs/explanation/performance.md for what each implementation runs, the
baselines and how short steps are timed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from hostavg.core.errors import ArgumentError
from hostavg.train.diagnose import MEASURED_FIRST

__all__ = ["CONFIG_MODELS", "DEFAULT_IMPLEMENTATIONS", "IMPLEMENTATIONS", "KERAS_IMPLEMENTATIONS",
           "OPTIMIZERS", "PROBE_ENV", "Config", "baseline", "batch_arguments", "defaults", "faces",
           "grid", "in_fresh_process", "keras_backend", "measure_memory", "median_s", "peak_bytes",
           "run", "status_kb", "time_config", "warmup_steps"]

#: What ``hostavg bench`` runs unless told otherwise (``--stats`` adds hostavg-stack+stats).
DEFAULT_IMPLEMENTATIONS = ("hostavg", "hostavg-stack", "hostavg-graph", "in-graph", "plain-host",
                           "full-batch", "hostavg-keras", "keras-accum")
IMPLEMENTATIONS = DEFAULT_IMPLEMENTATIONS + ("hostavg-stack+stats", "hostavg-overlap",
                                             "hostavg-caller", "hostavg-pool",
                                             "hostavg-unchecked",
                                             "hostavg-watched", "hostavg-keras-overlap",
                                             "hostavg-keras-unchecked", "hostavg-keras-watched")
#: The implementations that run on any Keras backend (the others are TF1 graphs).
KERAS_IMPLEMENTATIONS = ("hostavg-keras", "hostavg-keras-overlap", "hostavg-keras-unchecked",
                         "hostavg-keras-watched", "keras-accum")
#: What runs by default on a Keras backend other than TensorFlow.
KERAS_DEFAULT_IMPLEMENTATIONS = ("hostavg-keras", "keras-accum")
#: What ``hostavg bench --grid gpu`` runs unless told otherwise.
GPU_IMPLEMENTATIONS = ("hostavg-keras", "hostavg-keras-overlap", "keras-accum")
#: What ``hostavg bench --grid overhead`` runs unless told otherwise.
OVERHEAD_IMPLEMENTATIONS = ("hostavg", "hostavg-pool", "hostavg-caller", "full-batch",
                            "in-graph")
#: What every hostavg implementation is made with but the "-watched" ones, which time the
#: default watches: the bench steps each round's micro-batches many times, so a model that
#: learns them by heart meets the next round's as a spike, which
#: :class:`~hostavg.hooks.WatchOutliers` would search sample by sample inside the timing; and
#: :class:`~hostavg.hooks.Diagnose` has the first 20 applies, then one in 10, measure update
#: ratios, which would make the rows' times depend on how many steps a sample holds.
UNWATCHED = {"watch_outliers": False, "diagnose": False}
#: The defaults, for the "-watched" implementations.
WATCHED = {"watch_outliers": True, "diagnose": True}
#: The warm-up steps of a configuration that times a "-watched" implementation (every one of
#: its implementations takes them, so that all still end with the same weights): past the
#: applies where Diagnose measures update ratios every step, so that the rows time the steps
#: of most of a run, where it measures one in 10 (the median step then measures none).
WATCHED_WARMUP = MEASURED_FIRST + 1
#: The warm-up steps of a configuration that times a TF1 trainer with its default
#: ``session_threads="auto"``: past the first calls it runs both ways to time them
#: (:class:`hostavg.tf1.faster.Faster`: 2 * (2 + 5) calls of each session call, the apply's
#: being one a step after the first, whose apply is measured in a call of its own), so that
#: its rows time what the rest of a run takes. Each implementation takes them on its own,
#: before the interleaved timing: the calls' first times decide, and a run's first steps do
#: not run between four other programs' steps (which left the choice to chance here).
AUTO_WARMUP = 2 * (2 + 5) + 1
#: The optimizers a configuration can name (see :func:`_optimizer`).
OPTIMIZERS = ("adam", "sgd")
#: Most consecutive steps one timed sample may hold (see :func:`time_config`).
MAX_STEPS_PER_SAMPLE = 2000
#: ``min_sample_s`` of ``hostavg bench --grid overhead``, whose steps take a millisecond or less.
OVERHEAD_MIN_SAMPLE_S = 0.1

#: name -> (builder keyword arguments, description)
CONFIG_MODELS = {
    "mlp-50k": ("mlp", {"features": 784, "hidden": [64], "classes": 10}),
    "mlp-300k": ("mlp", {"features": 784, "hidden": [384], "classes": 10}),
    "mlp-2m": ("mlp", {"features": 784, "hidden": [1024, 1024], "classes": 10}),
    "conv": ("convnet", {"side": 28, "channels": [16, 32], "classes": 10}),
    "embedding": ("embedding", {"vocab": 100_000, "dim": 32, "length": 16, "classes": 10}),
    "logreg": ("mlp", {"features": 784, "hidden": [], "classes": 10}),
    "embedding-50k": ("embedding", {"vocab": 50_000, "dim": 64, "length": 16, "classes": 10}),
    # The GPU grid's: about 50M and 200M parameters (a gradient of 214 MB and 835 MB).
    "mlp-50m": ("mlp", {"features": 784, "hidden": [4096] * 4, "classes": 10}),
    "mlp-200m": ("mlp", {"features": 784, "hidden": [8192] * 4, "classes": 10}),
}
#: The models of the quick and full grids.
_GRID_MODELS = ("mlp-50k", "mlp-300k", "mlp-2m", "conv", "embedding")


@dataclass(frozen=True)
class Config:
    """One cell of the grid: a model, a micro-batch size, a number of micro-batches, an optimizer.

    ``optimizer`` is one of :data:`OPTIMIZERS` (default "adam"; ``str`` names
    it only when it is another).
    """

    model: str
    micro_batch_size: int
    k: int
    optimizer: str = "adam"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ArgumentError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                                f"got {self.optimizer!r}")

    def __str__(self):
        opt = "" if self.optimizer == "adam" else f" opt={self.optimizer}"
        return f"{self.model} micro={self.micro_batch_size} k={self.k}{opt}"


def baseline(config: Config, implementations=DEFAULT_IMPLEMENTATIONS) -> str:
    """The implementation ``config``'s ratios are to: ``full-batch`` at k = 1, else ``in-graph``;
    where that is not among ``implementations`` and ``keras-accum`` is, ``keras-accum``.

    With one micro-batch, ``full-batch`` is the program's own train op run on
    the same feed, so the ratio is what hostavg adds; with more, in-graph
    accumulation is what hostavg replaces. Among the Keras implementations
    alone (Keras on JAX), Keras's own accumulation is what hostavg replaces.
    """
    tf1 = "full-batch" if config.k == 1 else "in-graph"
    return "keras-accum" if tf1 not in implementations and "keras-accum" in implementations \
        else tf1


def keras_backend() -> str:
    """The backend Keras runs on in this process ("tensorflow", "jax", ...); imports Keras."""
    import keras
    return keras.backend.backend()


def defaults(grid_name: str, backend: str) -> tuple:
    """The implementations grid ``grid_name`` runs unless told otherwise, on Keras's ``backend``."""
    if grid_name == "gpu":
        return GPU_IMPLEMENTATIONS
    if backend != "tensorflow":
        return KERAS_DEFAULT_IMPLEMENTATIONS
    return OVERHEAD_IMPLEMENTATIONS if grid_name == "overhead" else DEFAULT_IMPLEMENTATIONS


def _build(model: str, seed: int = 0, keras: bool = False):
    from hostavg.cli import models
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


def _optimizer(name: str):
    """The TF1 optimizer ``name`` (one of :data:`OPTIMIZERS`)."""
    import tensorflow as tf
    train = tf.compat.v1.train
    return {"adam": lambda: train.AdamOptimizer(1e-3),
            "sgd": lambda: train.GradientDescentOptimizer(0.1)}[name]()


def _keras_optimizer(name: str, **kwargs):
    """The Keras 3 twin of ``_optimizer(name)``: the same update (Adam with TF1's epsilon)."""
    import keras
    opt = keras.optimizers
    return {"adam": lambda: opt.Adam(1e-3, epsilon=1e-8, **kwargs),
            "sgd": lambda: opt.SGD(0.1, **kwargs)}[name]()


class _Impl:
    """One implementation of an optimizer step over k micro-batches, in its own graph and session."""

    def __init__(self, config: Config, session_config=None):
        import tensorflow as tf
        self.tf, self.v1 = tf, tf.compat.v1
        self.config = config
        self.model = _build(config.model)
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
    def __init__(self, config, read_stats=False, trainer_kw=None, **kw):
        self.read_stats, self.trainer_kw = read_stats, {**UNWATCHED, **(trainer_kw or {})}
        super().__init__(config, **kw)

    def _build(self):
        from hostavg.tf1.trainer import Trainer
        self.trainer = Trainer(self.model.loss, _optimizer(self.config.optimizer), **self.trainer_kw)

    def step(self, micro):
        result = self.trainer.step(self.sess, [self.feed(x, y) for x, y in micro])
        if self.read_stats:
            st = result.stats
            (st.inner_product_test, st.orthogonality_test, st.gsnr, st.cosines)


class _InGraph(_Impl):
    def _build(self):
        tf, v1 = self.tf, self.v1
        opt = _optimizer(self.config.optimizer)
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
        opt = _optimizer(self.config.optimizer)
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
        self.train = _optimizer(self.config.optimizer).minimize(self.model.loss)

    def step(self, micro):
        self.sess.run(self.train, self.feed(np.concatenate([x for x, _ in micro]),
                                            np.concatenate([y for _, y in micro])))


class _KerasImpl:
    """One implementation on the Keras twin of the model."""

    def __init__(self, config: Config):
        self.config = config
        self.model = _build(config.model, keras=True)

    @property
    def parameters(self) -> int:
        return self.model.count_params()

    def weights(self) -> list:
        return [v.numpy() for v in self.model.trainable_variables]

    def close(self) -> None:
        pass


class _HostavgKeras(_KerasImpl):
    def __init__(self, config, **trainer_kw):
        super().__init__(config)
        from hostavg.cli import models
        from hostavg.keras.trainer import Trainer
        self.trainer = Trainer(self.model, models.keras_loss(), _keras_optimizer(config.optimizer),
                               **{**UNWATCHED, **trainer_kw})

    def step(self, micro):
        self.trainer.step(micro)


class _KerasAccumulation(_KerasImpl):
    def __init__(self, config):
        super().__init__(config)
        from hostavg.cli import models
        # Keras accepts gradient_accumulation_steps >= 2 only; one micro-batch is a plain step.
        steps = {"gradient_accumulation_steps": config.k} if config.k > 1 else {}
        self.model.compile(optimizer=_keras_optimizer(config.optimizer, **steps),
                           loss=models.keras_loss())

    def step(self, micro):
        for x, y in micro:
            self.model.train_on_batch(x, y)


def _make(name: str, config: Config, session_config=None):
    kw = {"session_config": session_config}
    return {"hostavg": lambda: _Hostavg(config, **kw),
            "hostavg-stack": lambda: _Hostavg(config, trainer_kw={"accumulate": "stack"}, **kw),
            "hostavg-stack+stats": lambda: _Hostavg(config, read_stats=True,
                                                    trainer_kw={"accumulate": "stack"}, **kw),
            "hostavg-graph": lambda: _Hostavg(config, trainer_kw={"average": "graph"}, **kw),
            "hostavg-overlap": lambda: _Hostavg(config, trainer_kw={"overlap": True}, **kw),
            "hostavg-caller": lambda: _Hostavg(config, trainer_kw={"session_threads": "caller"},
                                               **kw),
            "hostavg-pool": lambda: _Hostavg(config, trainer_kw={"session_threads": "pool"},
                                             **kw),
            "hostavg-unchecked": lambda: _Hostavg(config, trainer_kw={"check_applied": False},
                                                  **kw),
            "hostavg-watched": lambda: _Hostavg(config, trainer_kw=WATCHED, **kw),
            "in-graph": lambda: _InGraph(config, **kw),
            "plain-host": lambda: _PlainHost(config, **kw),
            "full-batch": lambda: _FullBatch(config, **kw),
            "hostavg-keras": lambda: _HostavgKeras(config),
            "hostavg-keras-overlap": lambda: _HostavgKeras(config, overlap=True),
            "hostavg-keras-unchecked": lambda: _HostavgKeras(config, check_applied=False),
            "hostavg-keras-watched": lambda: _HostavgKeras(config, **WATCHED),
            "keras-accum": lambda: _KerasAccumulation(config)}[name]()


def warmup_steps(implementations) -> int:
    """The warm-up steps before timing ``implementations``: see :data:`WATCHED_WARMUP` and
    :data:`AUTO_WARMUP`."""
    if any(n.endswith("-watched") for n in implementations):
        return max(WATCHED_WARMUP, AUTO_WARMUP)
    auto = [n for n in implementations if n.startswith("hostavg") and n not in
            KERAS_IMPLEMENTATIONS and n not in ("hostavg-pool", "hostavg-caller")]
    return AUTO_WARMUP if auto else 1


def faces(backend: str) -> tuple:
    """The hostavg faces a bench of one trainer method times on Keras's ``backend``: the TF1
    ``hostavg`` and ``hostavg-keras`` on TensorFlow, ``hostavg-keras`` alone elsewhere."""
    return ("hostavg", "hostavg-keras") if backend == "tensorflow" else ("hostavg-keras",)


def batch_arguments(impl, x, y) -> tuple:
    """The leading arguments of ``impl.trainer``'s compute, hvp and per_sample for the batch
    ``(x, y)``: ``(sess, feed_dict)`` on the TF1 face, ``(x, y)`` on the Keras face."""
    if isinstance(impl, _Impl):
        return impl.sess, impl.feed(x, y)
    return x, y


def time_config(config: Config, implementations=DEFAULT_IMPLEMENTATIONS, repeats: int = 7,
                warmup: int = 1, min_sample_s: float = 0.0) -> dict:
    """Median step seconds per implementation, timed interleaved; also their weights' agreement.

    After ``warmup`` consecutive steps of each, ``repeats`` rounds each draw new
    micro-batches and take one sample of every implementation on them, in an
    order that changes each round (:func:`_rounds`). A sample is
    ``steps_per_sample`` consecutive steps on that round's micro-batches and
    records their mean time: one step when ``min_sample_s`` is 0, else as many
    as the slowest implementation takes ``min_sample_s`` seconds for (per-step
    times from a few probe steps of each; at most ``MAX_STEPS_PER_SAMPLE``), the
    same for every implementation, after one untimed step. Every implementation
    takes the same steps on the same micro-batches, so all should end with the
    same weights: ``max_weight_diff`` is each one's largest difference from the
    first one's.
    """
    if not (min_sample_s >= 0 and math.isfinite(min_sample_s)):
        raise ArgumentError(f"min_sample_s must be a finite number >= 0, got {min_sample_s!r}")
    impls = {name: _make(name, config) for name in implementations}
    data = _batches(config.model, config, warmup + repeats)
    for impl in impls.values():  # each on its own, as a run starts (see AUTO_WARMUP)
        for micro in data[:warmup]:
            impl.step(micro)
    inner = _steps_per_sample(impls, data[0], min_sample_s)
    times = _rounds(impls, data[warmup:], inner)
    weights = {name: impl.weights() for name, impl in impls.items()}
    names = list(impls)
    reference = weights[names[0]]
    diff = {name: max(float(np.max(np.abs(a - b))) for a, b in zip(w, reference))
            for name, w in weights.items()}
    for impl in impls.values():
        impl.close()
    return {"median_s": {n: statistics.median(t) for n, t in times.items()},
            "iqr_s": {n: _iqr(t) for n, t in times.items()},
            "max_weight_diff": diff, "parameters": impls[names[0]].parameters,
            "steps_per_sample": inner}


def _rounds(impls: dict, data: list, inner: int) -> dict:
    """name -> the seconds a step of ``impls[name]`` took in each round, one round a
    micro-batch list of ``data``: each implementation in turn, in the round's order of
    :func:`_balanced_orders`, takes one untimed step and then ``inner`` timed ones (their mean).

    Interleaving shares the machine's drift (its clock, other processes) among the
    implementations. What one leaves the next (caches it filled, memory it freed, its
    thread pool still spinning) is shared too: each implementation follows every other
    equally often, and the untimed step keeps the first of it out of the sample. In a
    rotation one implementation followed the same one in most rounds, and where that was
    the slowest (in-graph accumulation's 8 ms steps, on a 3.2M-entry table) its samples read
    0.2-0.4 more of the baseline than the same trainer following a light implementation.
    """
    return _interleaved(list(impls), len(data), inner, True,
                        lambda name, r: functools.partial(impls[name].step, data[r]))


def _interleaved(names: list, rounds: int, inner: int, untimed: bool, call) -> dict:
    """name -> the mean seconds of ``inner`` consecutive calls of ``call(name, r)`` (a
    function of no arguments) in each round ``r``, the names in the round's order of
    :func:`_balanced_orders`, each after one untimed call of it where ``untimed``."""
    times = {name: [] for name in names}
    for r, order in enumerate(_balanced_orders(names, rounds)):
        for name in order:
            one = call(name, r)
            if untimed:
                one()
            t0 = time.perf_counter()
            for _ in range(inner):
                one()
            times[name].append((time.perf_counter() - t0) / inner)
    return times


def _balanced_orders(names: list, rounds: int) -> list[list]:
    """``rounds`` orders of ``names``, in which each name comes right after each other one
    equally often: the rows of a Williams design (a Latin square, each row also reversed
    where there is an odd number of names), cycled. Every ``len(names)`` rounds (twice that
    for an odd number) each name comes first, last and right after every other name as
    often as any."""
    n = len(names)
    if not n:
        return [[] for _ in range(rounds)]
    first = [0]
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    rows = [[names[(j + r) % n] for j in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [rows[r % len(rows)] for r in range(rounds)]


def median_s(calls: dict, repeats: int, inner: int = 1) -> dict:
    """name -> median seconds of ``inner`` consecutive ``calls[name]()``, interleaved in the
    orders of :func:`_balanced_orders`."""
    times = _interleaved(list(calls), repeats, inner, False, lambda name, r: calls[name])
    return {name: statistics.median(t) for name, t in times.items()}


def _steps_per_sample(impls: dict, micro: list, min_sample_s: float, probes: int = 5) -> int:
    """Steps that make the slowest implementation's sample last ``min_sample_s`` (1 if it is 0).

    Takes ``probes`` steps of each implementation on ``micro`` (all take
    them, so their weights stay equal) and uses the slowest median step time.
    """
    if min_sample_s == 0:
        return 1
    slowest = 0.0
    for impl in impls.values():
        steps = []
        for _ in range(probes):
            t0 = time.perf_counter()
            impl.step(micro)
            steps.append(time.perf_counter() - t0)
        slowest = max(slowest, statistics.median(steps))
    return max(1, min(MAX_STEPS_PER_SAMPLE, math.ceil(min_sample_s / slowest)))


def _iqr(values: list) -> float:
    """The interquartile range (0 for a single value)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


#: The environment of a memory probe's process. TensorFlow's plain CPU allocator: with oneDNN
#: (the default on x86) large tensors come from a pool that grows by regions and keeps what is
#: freed. glibc's malloc giving every block of 64 KiB or more back to the system when it is
#: freed: by default its threshold rises to the largest block freed, and each thread's arena
#: keeps what it frees, so a step's peak would depend on which threads ran it.
PROBE_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0",
             "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def measure_memory(probes, steps: int = 3) -> list[int]:
    """Peak memory in use added by ``steps`` steps of each ``(config, implementation)`` probe.

    The probes run one after the other in one fresh process (:func:`in_fresh_process`);
    each returns the peak resident set size during its steps above the one
    before them, in bytes, in the order given.
    """
    return in_fresh_process(_memory_probes, list(probes), steps)


def in_fresh_process(function, *arguments):
    """``function(*arguments)`` run in a fresh Python process with :data:`PROBE_ENV`; its result.

    ``function``: a module-level function whose result JSON can carry;
    ``arguments``: values whose ``repr`` rebuilds them (numbers, strings,
    lists, tuples, :class:`Config`). Raises RuntimeError with the process's
    stderr if it fails.
    """
    code = (f"import json; from hostavg.cli.bench import Config; "
            f"from {function.__module__} import {function.__name__} as probe; "
            f"print(json.dumps(probe(*{arguments!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, **PROBE_ENV), timeout=600)
    if out.returncode:
        raise RuntimeError(f"{function.__name__}{arguments!r} failed in a fresh process:\n"
                           f"{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _memory_probes(probes: list, steps: int) -> list[int]:
    return [_memory_probe(config, implementation, steps) for config, implementation in probes]


def _memory_probe(config: Config, implementation: str, steps: int) -> int:
    impl = _make(implementation, config)
    data = _batches(config.model, config, steps + 1)
    # Two steps of a single micro-batch first: kernels, caches and one gradient's buffers
    # are allocated then, and a step of k micro-batches cannot hide in memory it freed. Two:
    # the first apply is checked and the second proven, each its own compiled form on JAX,
    # whose compile is not a step's memory.
    for _ in range(2):
        impl.step(data[0][:1])
    peak = peak_bytes(lambda: [impl.step(micro) for micro in data[1:]])
    impl.close()
    return peak


def peak_bytes(call) -> int:
    """The peak resident set size while ``call()`` runs above the one before it, in bytes, at
    least 0 (Linux: /proc/self/clear_refs resets the peak, VmHWM, to the resident size, VmRSS;
    the kernel's count of it can lag a few pages behind VmRSS, so a call that adds nothing can
    read as a little below it)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kb("VmRSS")
    call()
    return max(0, (status_kb("VmHWM") - before) * 1024)


def status_kb(field: str) -> int:
    """A field of this process's /proc/self/status in kB (VmRSS, VmHWM: Linux only)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def grid(name: str) -> list[Config]:
    """The configurations of grid "quick" (the default), "full", "smallest", "overhead" or "gpu".

    smallest: mlp-50k, micro-batches of 32, k = 4 (a smoke test); quick: the
    five original models (mlp-50k, mlp-300k, mlp-2m, conv, embedding) at
    micro-batch size 32 with k = 4 and 8; full: micro-batch sizes 32 and 128
    with k = 4, 8 and 32. overhead: one micro-batch of 32 (k = 1) of logreg,
    mlp-50k and embedding-50k with Adam and of embedding-50k with SGD, whose
    baseline is the program's own train op; then embedding-50k at k = 8 with
    SGD and Adam against in-graph accumulation. gpu: MLPs of 2M, 50M and 200M
    parameters (mlp-2m, mlp-50m, mlp-200m) at micro-batch size 64 with k = 8.
    """
    if name == "gpu":
        return [Config(m, 64, 8) for m in ("mlp-2m", "mlp-50m", "mlp-200m")]
    if name == "smallest":
        return [Config("mlp-50k", 32, 4)]
    if name == "quick":
        return [Config(m, 32, k) for m in _GRID_MODELS for k in (4, 8)]
    if name == "overhead":
        return [*(Config(m, 32, 1, opt) for m, opt in (("logreg", "adam"), ("mlp-50k", "adam"),
                                                        ("embedding-50k", "adam"),
                                                        ("embedding-50k", "sgd"))),
                Config("embedding-50k", 32, 8, "sgd"), Config("embedding-50k", 32, 8, "adam")]
    return [Config(m, micro, k) for m in _GRID_MODELS for micro in (32, 128) for k in (4, 8, 32)]


def run(configs, implementations=DEFAULT_IMPLEMENTATIONS, repeats: int = 7, memory: bool = True,
        memory_config: Config = Config("mlp-2m", 32, 8), out=print, progress=None,
        min_sample_s: float = 0.0) -> dict:
    """Times every configuration, measures memory, prints tables; returns the JSON-ready results.

    Each configuration's ratios are to its :func:`baseline` (``ratio_to_baseline``,
    empty when that implementation is not run; ``ratio_to_in_graph`` is kept
    for older readers). ``min_sample_s``: see :func:`time_config`.
    ``progress``: a stream for one line per configuration and memory probe
    as it starts (default standard error; False for none).
    """
    say = _progress(progress)
    results = {"machine": _machine(), "repeats": repeats, "configs": []}
    if set(implementations) & set(KERAS_IMPLEMENTATIONS):
        results["keras_backend"] = keras_backend()
    first = max([28, *(len(str(c)) + 2 for c in configs)])
    widths = [max(len(n), 19) + 2 for n in implementations]
    out(f"{'configuration':<{first}}{'params':>10}" + "".join(f"{n:>{w}}" for n, w in
                                                               zip(implementations, widths)))
    samples = (f"{repeats} samples of each of {len(implementations)} implementations, a sample "
               f"being as many steps as the slowest takes {min_sample_s:g} s for"
               if min_sample_s else
               f"{repeats} steps of each of {len(implementations)} implementations")
    for i, config in enumerate(configs):
        say(f"timing {config} ({i + 1} of {len(configs)}): {samples}")
        r = time_config(config, implementations, repeats, min_sample_s=min_sample_s,
                        warmup=warmup_steps(implementations))
        t = r["median_s"]
        base_name = baseline(config, implementations)
        base = t.get(base_name)
        r["baseline"] = base_name
        r["ratio_to_baseline"] = {n: v / base for n, v in t.items()} if base else {}
        in_graph = t.get("in-graph")
        r["ratio_to_in_graph"] = {n: v / in_graph for n, v in t.items()} if in_graph else {}
        results["configs"].append({**dataclasses.asdict(config), **r})
        cells = "".join(f"{_cell(t[n], r['iqr_s'][n], base):>{w}}"
                        for n, w in zip(implementations, widths))
        out(f"{str(config):<{first}}{r['parameters']:>10,}{cells}")
    out("(each cell: median step time, its interquartile range in parentheses"
        + _ratio_note(configs, implementations))
    steps = sorted({c["steps_per_sample"] for c in results["configs"]})
    if steps and steps[-1] > 1:
        out(f"(times per step; each sample timed {steps[0]}"
            + (f" to {steps[-1]}" if len(steps) > 1 else "")
            + f" consecutive steps, as many as the slowest implementation takes "
              f"{min_sample_s:g} s for, after one untimed)")
    if {"hostavg-keras", "keras-accum"} <= set(implementations):
        out("\nKeras 3's own accumulation over hostavg's Keras engine (keras-accum / hostavg-keras):")
        for config, c in zip(configs, results["configs"]):
            t = c["median_s"]
            c["keras_accum_over_hostavg_keras"] = t["keras-accum"] / t["hostavg-keras"]
            out(f"  {str(config):<{first}}{c['keras_accum_over_hostavg_keras']:.2f}x")
    if memory:
        results["memory"] = _memory_tables(implementations, memory_config, out, say)
    return results


#: How the table's footer names each baseline, and where it is the baseline.
_BASELINE_WORDS = {
    "full-batch": ("full-batch, the program's own train op on the same feed", "k = 1"),
    "in-graph": ("in-graph accumulation", "k > 1"),
    "keras-accum": ("Keras's own accumulation", "the TF1 baseline does not run")}


def _ratio_note(configs, implementations) -> str:
    """The end of the table's footer: what each cell's ratio is relative to."""
    wanted = {baseline(c, implementations) for c in configs}
    shown = [b for b in _BASELINE_WORDS if b in wanted and b in implementations]
    if not shown:
        return ")"
    if wanted == set(shown) and len(shown) == 1:
        return f", and its ratio to {_BASELINE_WORDS[shown[0]][0]})"
    return (", and its ratio to the configuration's baseline: "
            + "; ".join("{}, where {}".format(*_BASELINE_WORDS[b]) for b in shown) + ")")


def _progress(stream):
    if stream is False:
        return lambda line: None
    return lambda line: print(f"bench: {line}", file=stream or sys.stderr, flush=True)


def _cell(seconds: float, iqr: float, base: float | None) -> str:
    """``median (iqr) ratio``, in milliseconds: to 0.01 ms under a millisecond, else to 0.1 ms."""
    digits = 2 if seconds < 1e-3 else 1
    return (f"{seconds * 1e3:.{digits}f}ms ({iqr * 1e3:.{digits}f})"
            + (f" {seconds / base:.2f}" if base else ""))


def _memory_tables(implementations, config: Config, out, say) -> dict:
    mib = 2 ** 20
    per_impl = {}
    for n in implementations:
        say(f"measuring memory: {n} on {config}, in a fresh process")
        (per_impl[n],) = measure_memory([(config, n)])
    out(f"\npeak extra host memory per step, {config}:")
    for n, b in per_impl.items():
        out(f"  {n:<22}{b / mib:8.1f} MiB")
    scaling = {}
    for n in ("hostavg", "hostavg-stack", "hostavg-keras"):
        if n in implementations:
            say(f"measuring memory: {n} at k = 4 and 64")
            scaling[n] = {k: measure_memory([(dataclasses.replace(config, k=k), n)])[0]
                          for k in (4, 64)}
            out(f"  {n:<22}k=4: {scaling[n][4] / mib:.1f} MiB, k=64: {scaling[n][64] / mib:.1f} MiB")
    return {"config": str(config), "peak_bytes": per_impl, "k_scaling": scaling}


def _machine() -> dict:
    import platform
    return {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version()}
