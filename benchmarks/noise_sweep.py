"""The critical batch size measured by a sweep, against the noise scale B_simple hostavg reports.

    python benchmarks/noise_sweep.py [--batches 8,16,...] [--lrs 1e-3,...]
                                     [--targets 0.15,0.05,0.02] [--json PATH]

The model and data are the inspecting guide's (docs/guides/inspecting.md): an MLP
20 -> 64 -> 2 on 2,048 samples, Adam. For each batch size B, each learning rate of the grid
trains from the same initial weights on batches drawn afresh each step (with replacement,
seed fixed); for each target, S(B) is the fewest steps any learning rate took until the loss
over all 2,048 samples was at most the target. McCandlish et al. (2018, eq. 2.11) model the
trade-off as S = S_min (1 + B_crit / B); a least-squares fit in log S gives S_min and B_crit.
Beside it: hostavg's running noise scale B_simple (``hostavg.NoiseScale(beta=0.9)``) in the
guide's own fit (batches of 256 in micro-batches of 32) at the step where its loss first
reaches the same target: the noise scale grows as the loss falls, so each is compared with
the B_crit of where training is.

Prints a table per target and writes every number as JSON. About two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

import hostavg

tf = hostavg.import_tensorflow()
v1 = tf.compat.v1


def data() -> tuple[np.ndarray, np.ndarray]:
    """The inspecting guide's samples."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 20)).astype(np.float32)
    y = (x @ rng.normal(size=20) + 0.5 * rng.normal(size=2048) > 0).astype(np.int32)
    return x, y


def build(lr: float, **trainer_kw):
    """The guide's ``build``: a graph, its session, its train op, loss and placeholders, and a
    hostavg.Trainer of it."""
    r = np.random.default_rng(0)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 20], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w1 = tf.Variable(r.normal(0, 20 ** -0.5, (20, 64)).astype(np.float32), name="w1")
        b1 = tf.Variable(np.zeros(64, np.float32), name="b1")
        w2 = tf.Variable(r.normal(0, 64 ** -0.5, (64, 2)).astype(np.float32), name="w2")
        b2 = tf.Variable(np.zeros(2, np.float32), name="b2")
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        optimizer = v1.train.AdamOptimizer(lr)
        trainer = hostavg.Trainer(loss, optimizer, **trainer_kw) if trainer_kw else None
        train_op = optimizer.minimize(loss)
        init = v1.global_variables_initializer()
    config = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    sess = v1.Session(graph=graph, config=config)
    sess.run(init)
    return sess, train_op, loss, x, y, trainer


def steps_to_targets(batch: int, lr: float, targets: list, max_steps: int) -> dict:
    """target -> the steps of Adam(lr) on fresh batches of ``batch`` until the loss over all the
    data is at most ``target`` (None if not within ``max_steps``), in one run."""
    x_all, y_all = data()
    sess, train_op, loss, x, y, _ = build(lr)
    rng = np.random.default_rng(1)
    found = dict.fromkeys(targets)
    with sess:
        for step in range(1, max_steps + 1):
            rows = rng.integers(0, len(y_all), batch)
            sess.run(train_op, {x: x_all[rows], y: y_all[rows]})
            now = sess.run(loss, {x: x_all, y: y_all})
            for t in targets:
                if found[t] is None and now <= t:
                    found[t] = step
            if all(v is not None for v in found.values()):
                break
    return found


def noise_scale(targets: list, epochs: int) -> dict:
    """target -> hostavg's running noise scale (``NoiseScale(beta=0.9)``) at the first step of
    the guide's fit (batches of 256 in micro-batches of 32, Adam 1e-2) whose loss over all
    the data is at most the target (None if it never is), with that step."""
    x_all, y_all = data()
    noise = hostavg.NoiseScale(beta=0.9)
    found = {}

    class Each:
        def on_applied(self, result):
            now = sess.run(loss, {x: x_all, y: y_all})
            for t in targets:
                if t not in found and now <= t:
                    found[t] = {"b_simple": noise.b_simple, "step": result.step}

    sess, _, loss, x, y, trainer = build(1e-2, hooks=[noise, Each()], accumulate="stack")
    with sess:
        trainer.fit(sess, {x: x_all, y: y_all}, batch_size=256, micro_batch_size=32,
                    epochs=epochs, seed=0, progress=False)
    return {t: found.get(t) for t in targets}


def fit_critical(batches: list, steps: list) -> tuple[float, float]:
    """(S_min, B_crit) of S = S_min (1 + B_crit / B), least squares in log S (every batch size
    counts alike, not the small ones' many steps): B_crit searched on a fine log grid, S_min
    then in closed form."""
    b, log_s = np.asarray(batches, float), np.log(np.asarray(steps, float))

    def fitted(crit: float) -> tuple[float, float]:
        shape = np.log1p(crit / b)
        log_min = float(np.mean(log_s - shape))
        return float(np.sum((log_s - log_min - shape) ** 2)), math.exp(log_min)

    grid = np.geomspace(b.min() / 100, b.max() * 100, 4001)
    crit = min(grid, key=lambda c: fitted(c)[0])
    return fitted(crit)[1], float(crit)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="8,16,32,64,128,256,512,1024,2048")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1,3e-1")
    parser.add_argument("--targets", default="0.15,0.05,0.02")
    parser.add_argument("--max-steps", type=int, default=5000)
    parser.add_argument("--epochs", type=int, default=24, help="of the guide's fit")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    lrs = [float(v) for v in args.lrs.split(",")]
    targets = [float(v) for v in args.targets.split(",")]
    t0 = time.perf_counter()
    runs = {(b, lr): steps_to_targets(b, lr, targets, args.max_steps) for b in batches for lr in lrs}
    noise = noise_scale(targets, args.epochs)
    out = {"command": " ".join(["python", "benchmarks/noise_sweep.py", *(argv or sys.argv[1:])]),
           "targets": {}}
    for t in targets:
        best = {}
        for b in batches:
            took = [(runs[b, lr][t], lr) for lr in lrs if runs[b, lr][t] is not None]
            if took:
                best[b] = min(took)
        s_min, b_crit = fit_critical(list(best), [s for s, _ in best.values()])
        out["targets"][str(t)] = {
            "best": {str(b): {"steps": s, "lr": lr} for b, (s, lr) in best.items()},
            "s_min": s_min, "b_crit": b_crit, "noise_scale": noise[t]}
        print(f"\nto a loss of {t} over all 2,048 samples:")
        print(f"{'batch':>6} {'steps':>6} {'lr':>7} {'samples':>8}")
        for b, (s, lr) in best.items():
            print(f"{b:>6} {s:>6} {lr:>7g} {b * s:>8}")
        said = "never reached" if noise[t] is None else \
            f"{noise[t]['b_simple']:.0f} at step {noise[t]['step']}"
        print(f"fit S = S_min (1 + B_crit / B): S_min {s_min:.0f} steps, B_crit {b_crit:.0f}; "
              f"B_simple of the guide's fit when it gets there: {said}")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
