"""``hostavg bench --programs``: Keras programs of published shape, ``Trainer.fit`` against ``model.fit``.

Each program (:data:`PROGRAMS`) is a keras-io example's model, loss, metric
and batch size, on generated data of its input shape. Both implementations
start from the same weights and train the same epochs of the same unshuffled
samples, with the same callbacks (an ``EarlyStopping`` that never stops, and
``History``): ``keras-fit`` is ``model.fit`` with micro-batches of
``batch_size / k`` and ``gradient_accumulation_steps=k`` (Keras's own
accumulation); ``hostavg-fit`` is :meth:`hostavg.keras.Trainer.fit` with
``batch_size`` and ``micro_batch_size=batch_size / k``, with the trainer's
defaults (its watches included). Epochs are timed interleaved, after warm-up
epochs past the first :data:`~hostavg.train.diagnose.MEASURED_FIRST` applies,
so that no compile and no first-steps measuring falls in a timed epoch. The
watches' warnings are silenced: on generated data they describe the data.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from hostavg.cli import bench
from hostavg.train.diagnose import DiagnosisWarning
from hostavg.train.hooks import OutlierWarning

__all__ = ["BATCH_SIZES", "IMPLEMENTATIONS", "PROGRAMS", "Program", "build", "run", "time_program",
           "twins"]

#: The timed implementations, in the table's order.
IMPLEMENTATIONS = ("keras-fit", "hostavg-fit")
#: Steps (of ``batch_size`` samples) per timed epoch.
STEPS = 8


@dataclass(frozen=True)
class Program:
    """A compiled-to-be Keras program: its model, loss, metrics, data and the example's batch size."""

    model: object
    loss: str
    x: np.ndarray
    y: np.ndarray
    batch_size: int
    metrics: tuple = ("accuracy",)


def _convnet(rng, n: int, dropout: float) -> Program:
    """keras-io "Simple MNIST convnet": two 3x3 convolutions with pooling, batch size 128."""
    import keras
    layers = keras.layers
    model = keras.Sequential([
        keras.Input((28, 28, 1)), layers.Conv2D(32, 3, activation="relu"), layers.MaxPooling2D(2),
        layers.Conv2D(64, 3, activation="relu"), layers.MaxPooling2D(2), layers.Flatten(),
        layers.Dropout(dropout), layers.Dense(10, activation="softmax")])
    y = keras.utils.to_categorical(rng.integers(0, 10, n), 10)
    return Program(model, "categorical_crossentropy", rng.random((n, 28, 28, 1), np.float32), y,
                   BATCH_SIZES["convnet"])


def _bilstm(rng, n: int, dropout: float) -> Program:
    """keras-io "Bidirectional LSTM on IMDB": 20,000 words, 200 tokens, two BiLSTMs of 64, batch 32."""
    import keras
    layers = keras.layers
    tokens = keras.Input((None,), dtype="int32")
    h = layers.Embedding(20_000, 128)(tokens)
    h = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(h)
    h = layers.Bidirectional(layers.LSTM(64))(h)
    model = keras.Model(tokens, layers.Dense(1, activation="sigmoid")(h))
    return Program(model, "binary_crossentropy", rng.integers(0, 20_000, (n, 200)),
                   rng.integers(0, 2, n).astype("float32"), BATCH_SIZES["bilstm"])


def _structured(rng, n: int, dropout: float) -> Program:
    """keras-io "Structured data classification": 13 features normalized in the model (a
    ``Normalization`` layer adapted to the data), Dense(32), Dropout(0.5), batch size 32."""
    import keras
    layers = keras.layers
    x = rng.normal(3.0, 2.0, (n, 13)).astype("float32")
    y = (x[:, 0] + rng.normal(0.0, 1.0, n) > 3.0).astype("float32")
    norm = layers.Normalization()
    norm.adapt(x)
    model = keras.Sequential([keras.Input((13,)), norm, layers.Dense(32, activation="relu"),
                              layers.Dropout(dropout), layers.Dense(1, activation="sigmoid")])
    return Program(model, "binary_crossentropy", x, y, BATCH_SIZES["structured"])


def _transformer(rng, n: int, dropout: float) -> Program:
    """keras-io "Text classification with Transformer": token and position embeddings of 32,
    one block (2 heads, feed-forward 32), 200 tokens of 20,000 words, batch size 32."""
    import keras
    layers = keras.layers
    tokens = keras.Input((200,), dtype="int32")
    h = layers.Embedding(20_000, 32)(tokens) + layers.Embedding(200, 32)(keras.ops.arange(200))
    attended = layers.Dropout(dropout / 5)(layers.MultiHeadAttention(2, 32)(h, h))
    h = layers.LayerNormalization(epsilon=1e-6)(h + attended)
    ff = layers.Dense(32)(layers.Dense(32, activation="relu")(h))
    h = layers.LayerNormalization(epsilon=1e-6)(h + layers.Dropout(dropout / 5)(ff))
    h = layers.Dropout(dropout / 5)(layers.GlobalAveragePooling1D()(h))
    h = layers.Dropout(dropout / 5)(layers.Dense(20, activation="relu")(h))
    model = keras.Model(tokens, layers.Dense(2, activation="softmax")(h))
    return Program(model, "sparse_categorical_crossentropy", rng.integers(0, 20_000, (n, 200)),
                   rng.integers(0, 2, n), BATCH_SIZES["transformer"])


#: name -> the builder ``(rng, samples, dropout) -> Program`` (its docstring names the example).
PROGRAMS = {"convnet": _convnet, "bilstm": _bilstm, "structured": _structured,
            "transformer": _transformer}
#: name -> the example's batch size.
BATCH_SIZES = {"convnet": 128, "bilstm": 32, "structured": 32, "transformer": 32}


def build(name: str, samples: int | None = None, seed: int = 0, dropout: float = 0.5) -> Program:
    """Program ``name`` on ``samples`` generated samples (default :data:`STEPS` batches).

    ``dropout``: the examples' 0.5 (the transformer's layers take a fifth of
    it, its 0.1); 0 makes both implementations' training deterministic.
    """
    import keras
    keras.utils.set_random_seed(seed)
    return PROGRAMS[name](np.random.default_rng(seed), samples or STEPS * BATCH_SIZES[name],
                          dropout)


def twins(name: str, k: int = 4, samples: int | None = None, dropout: float = 0.5) -> tuple:
    """``(fits, models)``: implementation -> a callable that trains one epoch, and the two
    models they train (``keras-fit``'s, ``hostavg-fit``'s), with the same initial weights."""
    import keras
    from hostavg.keras.trainer import Trainer
    program = build(name, samples, dropout=dropout)
    # Built again rather than cloned: a clone's Normalization layer does not normalize with
    # the adapted statistics that set_weights copies (Keras computes them in adapt).
    twin = build(name, samples, dropout=dropout).model
    twin.set_weights(program.model.get_weights())
    micro = program.batch_size // k
    program.model.compile(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=k),
                          loss=program.loss, metrics=list(program.metrics))
    twin.compile(optimizer=keras.optimizers.Adam(), loss=program.loss,
                 metrics=list(program.metrics))
    trainer = Trainer(twin, micro_batch_size=micro)

    def callbacks():
        return [keras.callbacks.EarlyStopping(monitor="loss", patience=10 ** 6)]
    common = {"epochs": 1, "verbose": 0, "shuffle": False}
    return {"keras-fit": lambda: program.model.fit(program.x, program.y, batch_size=micro,
                                                   callbacks=callbacks(), **common),
            "hostavg-fit": lambda: trainer.fit(program.x, program.y,
                                               batch_size=program.batch_size,
                                               callbacks=callbacks(), **common)}, \
        (program.model, twin)


def time_program(name: str, k: int = 4, repeats: int = 7, samples: int | None = None,
                 dropout: float = 0.5) -> dict:
    """Program ``name``'s median epoch seconds per implementation, interleaved, and the ratio
    ``hostavg-fit / keras-fit``; ``samples`` per epoch (default :data:`STEPS` batches)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DiagnosisWarning)
        warnings.simplefilter("ignore", OutlierWarning)
        return _timed(twins(name, k, samples, dropout)[0], name, k, repeats)


def _timed(fits: dict, name: str, k: int, repeats: int) -> dict:
    """``fits``' median epoch seconds after the warm-up epochs, interleaved in turn."""
    warmup = math.ceil(bench.WATCHED_WARMUP / STEPS) + 1
    for fit in fits.values():
        for _ in range(warmup):
            fit()
    median = bench.median_s({n: fits[n] for n in IMPLEMENTATIONS}, repeats)
    return {"program": name, "k": k, "median_s": median,
            "ratio": median["hostavg-fit"] / median["keras-fit"]}


def run(names, k: int = 4, repeats: int = 7, out=print) -> list:
    """Times every program in ``names``, prints a table; returns the rows."""
    backend = bench.keras_backend()
    out(f"{'program (Keras on ' + backend + ')':<32}{'keras-fit':>12}{'hostavg-fit':>13}{'ratio':>7}")
    rows = []
    for name in names:
        r = time_program(name, k, repeats)
        rows.append(r)
        t = r["median_s"]
        out(f"{name + f' k={k}':<32}{t['keras-fit'] * 1e3:>10.0f}ms{t['hostavg-fit'] * 1e3:>11.0f}ms"
            f"{r['ratio']:>7.2f}")
    out(f"(median seconds of one epoch of {STEPS} steps, {repeats} epochs each, interleaved; "
        f"ratio: hostavg-fit / keras-fit)")
    return rows
