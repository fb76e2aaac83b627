"""Host memory on the per-micro-batch path: what one step of k micro-batches allocates on the host.

    python benchmarks/host_memory.py [--model mlp-2m] [--k 4,16] [--micro 32] [--steps 3]

Each case runs in a fresh process (so one case's freed memory cannot hide
another's allocations) and reports, per step after a warm-up step:

* ``numpy_peak``: the peak of memory NumPy allocated during the step
  (``tracemalloc``: the accumulator, the mean, copies; not what a framework
  allocates itself);
* ``rss_peak``: the peak resident set size above the one before the step
  (``VmHWM``, reset through ``/proc/self/clear_refs``): everything, the
  framework's output buffers included;
* ``faults_per_micro``: minor page faults per micro-batch (``getrusage``): a
  gradient written into memory new to the process faults once per 4 KiB
  page; into memory written before, not at all;
* ``step_s``: the median step time.

Cases: ``keras-jax`` (hostavg.keras on Keras's JAX backend, as it is),
``keras-jax-fresh`` (the same with ``reuses_buffers`` off before the first
compute: every compute's gradients in new buffers, as before buffers were
reused), ``keras-tf`` (hostavg.keras on TensorFlow) and ``tf1`` (hostavg.Trainer).
A case whose framework is not installed is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).parents[1]
#: case -> KERAS_BACKEND its process runs with.
CASES = {"keras-jax": "jax", "keras-jax-fresh": "jax", "keras-tf": "tensorflow",
         "tf1": "tensorflow"}


def measure(case: str, model: str, micro: int, k: int, steps: int) -> dict:
    """One case, in this process: see the module docstring."""
    from hostavg.cli import bench
    config = bench.Config(model, micro, k)
    impl = bench._make("hostavg" if case == "tf1" else "hostavg-keras", config)
    if case == "keras-jax-fresh":
        impl.trainer._backend.reuses_buffers = False  # before the first compute: no donation
    data = bench._batches(model, config, steps + 1)
    impl.step(data[0])  # compiles, builds the optimizer, allocates the accumulator
    rows = []
    for micro_batches in data[1:]:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set size starts again from the current one
        before, faults = bench.status_kb("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tracemalloc.start()
        t0 = time.perf_counter()
        impl.step(micro_batches)
        seconds = time.perf_counter() - t0
        numpy_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append({"numpy_peak": numpy_peak, "rss_peak": (bench.status_kb("VmHWM") - before) * 1024,
                     "faults_per_micro": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                                          - faults) / k, "step_s": seconds})
    return {"case": case, "model": model, "micro": micro, "k": k,
            "parameters": impl.parameters,
            **{key: statistics.median(r[key] for r in rows) for key in rows[0]}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp-2m")
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--k", default="4,16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a case, in this process
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.k.split(",")]
    if args.one:
        print(json.dumps(measure(args.one, args.model, args.micro, ks[0], args.steps)))
        return 0
    results = []
    mib = 2 ** 20
    print(f"{'case':<17}{'k':>4}{'numpy peak':>12}{'RSS peak':>11}{'faults/micro':>14}"
          f"{'step':>10}")
    for case in args.cases.split(","):
        for k in ks:
            env = dict(os.environ, KERAS_BACKEND=CASES[case], TF_CPP_MIN_LOG_LEVEL="3",
                       PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            out = subprocess.run([sys.executable, __file__, "--one", case, "--model", args.model,
                                  "--micro", str(args.micro), "--k", str(k),
                                  "--steps", str(args.steps)], capture_output=True, text=True,
                                 env=env)
            if out.returncode:
                print(f"{case:<17}{k:>4}  failed: {out.stderr.strip().splitlines()[-1]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{case:<17}{k:>4}{r['numpy_peak'] / mib:>9.1f} MiB{r['rss_peak'] / mib:>7.1f} MiB"
                  f"{r['faults_per_micro']:>14.0f}{r['step_s'] * 1e3:>8.1f}ms")
    print(f"({args.model}: {results[0]['parameters']:,} parameters, "
          f"{results[0]['parameters'] * 4 / mib:.1f} MiB of float32 gradient; micro-batches of "
          f"{args.micro}; medians over {args.steps} steps after one warm-up step)" if results else "")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
