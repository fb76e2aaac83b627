"""``hostavg bench --per-sample``: what ``per_sample`` costs on each face.

Per configuration (a model and a batch of ``micro_batch_size`` samples) and face (the
TF1 ``hostavg`` and ``hostavg-keras``, or on JAX ``hostavg-keras`` alone): the median
time of one ``trainer.compute`` of the whole batch, of one ``trainer.per_sample`` of the
same batch (its default chunk size, printed), and their ratio. Then per face the peak
resident memory that one ``per_sample`` of a larger batch (:data:`MEMORY_CONFIG`) adds, at
:data:`MEMORY_CHUNK_SIZE` and with the whole batch as one chunk, each in a fresh process,
beside the size of one chunk's float32 per-sample gradients: what the chunk size bounds.
"""

from __future__ import annotations

from hostavg.cli import bench
from hostavg.engine.samples import default_chunk_size

__all__ = ["FORMAT", "MEMORY_CHUNK_SIZE", "MEMORY_CONFIG", "MODELS", "SAMPLES", "measure_memory",
           "memory", "run", "time_per_sample"]

#: The models ``hostavg bench --per-sample`` times unless ``--models`` names others.
MODELS = ("mlp-50k", "conv")
#: The batch sizes it times unless ``--micro-batch-sizes`` names others.
SAMPLES = (256,)
#: The batch whose ``per_sample`` memory is measured: 1,000 samples of the conv model.
MEMORY_CONFIG = bench.Config("conv", 1000, 1)
#: The chunk size whose bound the memory probe shows beside the whole batch as one chunk
#: (the default chunk of the conv model, 64 MiB of gradients, is 818 samples).
MEMORY_CHUNK_SIZE = 64
#: The version of the JSON that :func:`run` returns, for readers of older files.
FORMAT = 1
#: Bytes of one float32 parameter of a sample's gradient.
FLOAT32_BYTES = 4
#: The warm-up's samples before the measured ``per_sample`` of a batch that is one chunk.
WARMUP_SAMPLES = 8


def _label(config: bench.Config) -> str:
    """``config`` as its table rows name it: the model and the batch's samples."""
    return f"{config.model}, {config.micro_batch_size:,} samples"


def _batch(config: bench.Config) -> tuple:
    """The batch ``(x, y)`` of ``config.micro_batch_size`` samples of ``config.model``."""
    return bench._batches(config.model, config, 1)[0][0]


def time_per_sample(config: bench.Config, face: str, repeats: int = 5,
                    chunk_size: int | None = None) -> dict:
    """The median seconds of one ``compute`` and one ``per_sample`` (of ``chunk_size``, or its
    default) of ``config``'s batch on ``face``, interleaved (:func:`bench.median_s`) after one
    untimed call of each (tracing, compiling), their ratio, the model's parameters and the
    chunk size."""
    impl = bench._make(face, config)
    trainer, arguments = impl.trainer, bench.batch_arguments(impl, *_batch(config))
    calls = {"compute": lambda: trainer.compute(*arguments),
             "per_sample": lambda: trainer.per_sample(*arguments, chunk_size=chunk_size)}
    for call in calls.values():
        call()
    seconds = bench.median_s(calls, repeats)
    impl.close()
    return {"parameters": impl.parameters,
            "chunk_size": chunk_size or default_chunk_size(trainer.spec),
            "compute_s": seconds["compute"],
            "per_sample_s": seconds["per_sample"],
            "ratio": seconds["per_sample"] / seconds["compute"]}


def run(configs, backend: str, repeats: int = 5, memory_config: bench.Config | None = MEMORY_CONFIG,
        out=print, chunk_size: int | None = None) -> dict:
    """Times every configuration on every face of ``backend`` (per_sample of ``chunk_size``, or
    its default) and prints a table; then, unless ``memory_config`` is None, measures
    :func:`memory` on it.

    Returns what ``--json`` writes: ``format`` (:data:`FORMAT`), ``machine``,
    ``keras_backend``, ``repeats``, ``timing``: a row per configuration and face
    (``model``, ``samples``, ``face``, ``chunk_size``, ``parameters``, ``compute_s``
    and ``per_sample_s`` in seconds, ``ratio`` = per_sample_s / compute_s), and
    ``memory``: :func:`memory`'s rows, where measured.
    """
    out(f"{'configuration':<26}{'face':<15}{'params':>9}{'chunk':>7}{'compute':>11}"
        f"{'per_sample':>12}{'ratio':>8}")
    timing = []
    for config in configs:
        for face in bench.faces(backend):
            r = {"model": config.model, "samples": config.micro_batch_size, "face": face,
                 **time_per_sample(config, face, repeats, chunk_size)}
            timing.append(r)
            out(f"{_label(config):<26}{face:<15}{r['parameters']:>9,}{r['chunk_size']:>7,}"
                f"{r['compute_s'] * 1e3:>9.2f}ms{r['per_sample_s'] * 1e3:>10.1f}ms"
                f"{r['ratio']:>7.1f}x")
    out(f"(compute: one call on the whole batch; per_sample: one call on the same batch, "
        f"chunk_size {'its default (64 MiB of gradients)' if chunk_size is None else chunk_size}"
        f"; medians of {repeats}, interleaved, after one untimed call of each; ratio: "
        f"per_sample / compute)")
    results = {"format": FORMAT, "machine": bench._machine(), "keras_backend": backend,
               "repeats": repeats, "timing": timing}
    if memory_config is not None:
        results["memory"] = memory(memory_config, bench.faces(backend), out=out)
    return results


def memory(config: bench.Config = MEMORY_CONFIG, faces=("hostavg",),
           chunk_sizes: tuple | None = None, out=print, progress=None) -> list:
    """The peak extra resident memory of one ``per_sample`` of ``config``'s batch per face of
    ``faces`` and chunk size of ``chunk_sizes`` (default: :data:`MEMORY_CHUNK_SIZE` and the
    whole batch), each in a fresh process (:func:`measure_memory`); prints them and returns
    the rows: ``model``, ``samples``, ``face``, ``chunk_size``, ``parameters``,
    ``gradients_bytes`` (one chunk's float32 per-sample gradients) and ``peak_bytes``.
    ``progress``: a stream for a line per probe as it starts (default standard error; False
    for none).
    """
    say = bench._progress(progress)
    n = config.micro_batch_size
    chunk_sizes = chunk_sizes or sorted({min(MEMORY_CHUNK_SIZE, n), n})
    mib = 2 ** 20
    out(f"\npeak extra resident memory of one per_sample of {_label(config)}, each in a fresh "
        f"process:")
    out(f"  {'face':<15}{'chunk_size':>11}{'chunk gradients':>17}{'peak':>12}")
    rows = []
    for face in faces:
        for chunk in chunk_sizes:
            say(f"measuring memory: per_sample of {_label(config)} on {face} with "
                f"chunk_size={chunk}, in a fresh process")
            parameters, peak = measure_memory(config, face, chunk)
            rows.append({"model": config.model, "samples": n, "face": face, "chunk_size": chunk,
                         "parameters": parameters,
                         "gradients_bytes": parameters * FLOAT32_BYTES * chunk, "peak_bytes": peak})
            out(f"  {face:<15}{chunk:>11,}{rows[-1]['gradients_bytes'] / mib:>13.1f} MiB"
                f"{peak / mib:>8.1f} MiB")
    out("(chunk gradients: parameters x 4 bytes x chunk_size, the float32 per-sample gradients "
        "of one chunk; peak: the resident set's peak during the call above the one before it)")
    return rows


def measure_memory(config: bench.Config, face: str, chunk_size: int) -> tuple[int, int]:
    """``(parameters, peak bytes)``: the model's parameters, and the peak resident memory one
    ``per_sample(..., chunk_size=chunk_size)`` of ``config``'s batch adds on ``face``, in a
    fresh process (:func:`bench.in_fresh_process`)."""
    return tuple(bench.in_fresh_process(_memory_probe, config, face, chunk_size))


def _memory_probe(config: bench.Config, face: str, chunk_size: int) -> list[int]:
    """:func:`measure_memory` in this process, after an untimed ``per_sample`` of
    :func:`_warmup_size` samples (kernels traced and allocated)."""
    impl = bench._make(face, config)
    x, y = _batch(config)
    warm = _warmup_size(len(x), chunk_size)
    impl.trainer.per_sample(*bench.batch_arguments(impl, x[:warm], y[:warm]),
                            chunk_size=chunk_size)
    arguments = bench.batch_arguments(impl, x, y)
    peak = bench.peak_bytes(lambda: impl.trainer.per_sample(*arguments, chunk_size=chunk_size))
    impl.close()
    return [impl.parameters, peak]


def _warmup_size(samples: int, chunk_size: int) -> int:
    """The samples of the warm-up before a measured ``per_sample`` of ``samples`` samples: one
    chunk and the last, shorter one (or a second whole one), so that both chunk shapes and
    the functions of a batch of several chunks are traced; where the batch is
    one chunk, :data:`WARMUP_SAMPLES` alone (its one shape is then traced in the measured
    call), since a warm-up as large as the batch would leave the measured call the memory
    that it freed (glibc keeps the freed blocks smaller than its mmap threshold)."""
    if chunk_size >= samples:
        return min(WARMUP_SAMPLES, samples)
    return chunk_size + (samples % chunk_size or chunk_size)
