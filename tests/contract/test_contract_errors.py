"""Which error a failure raises, the same on every face: an ArgumentError (also a ValueError)
for what is refused before anything runs, a StepError (also a RuntimeError) for what fails
while a step runs; both HostavgErrors, and after either nothing has changed.

Each case is one row of the table in docs/explanation/errors.md.
"""

import numpy as np
import pytest
from backends import BATCH, SIZES, same
from models import FEATURES, batches

import hostavg


def raised(face, action, kind):
    """Runs ``action``; asserts it raises ``kind`` and changes nothing; returns the error."""
    before = face.values()
    with pytest.raises(kind) as caught:
        action()
    same(face.values(), before)
    return caught.value


def started(backend, **kw):
    """A face of the batch-norm model that has stepped once (slots, step, moving statistics
    non-trivial), and the next batch."""
    face = backend.make("batchnorm", **kw)
    data = batches(4, 2, BATCH)
    face.step(face.cut(data[0], SIZES))
    return face, data[1]


def test_an_argument_refused_before_anything_runs_is_an_argument_error(backend):
    face, data = started(backend)
    micro = face.cut(data, SIZES)
    error = raised(face, lambda: face.step(micro, sizes=[5, 11]), hostavg.ArgumentError)
    assert isinstance(error, ValueError) and isinstance(error, hostavg.HostavgError)
    assert not isinstance(error, hostavg.StepError)
    assert str(error) == "sizes must hold one number of samples per micro-batch (3), got [5, 11]"
    narrow = dict(data, x=np.ones((BATCH, FEATURES - 1), np.float32))
    raised(face, lambda: face.step(face.cut(narrow, SIZES)), hostavg.ArgumentError)
    with pytest.raises(hostavg.ArgumentError, match=r"^micro_batch_size must be an integer >= 1, "
                                                    r"got 0$"):
        backend.make(micro_batch_size=0)
    with pytest.raises(hostavg.ArgumentError, match=r"^statistics\['mean'\] must be a function"):
        backend.make(statistics={"mean": 1.0})


def test_a_nan_micro_batch_is_a_step_error(backend):
    face, data = started(backend)
    data = dict(data, x=data["x"].copy())
    data["x"][SIZES[0] + 3, 2] = np.nan
    error = raised(face, lambda: face.step(face.cut(data, SIZES)), hostavg.StepError)
    assert isinstance(error, RuntimeError) and not isinstance(error, ValueError)
    assert "micro-batch 1 of 3" in str(error) and "non-finite gradients" in str(error)


@pytest.mark.parametrize("model", ["mlp", "embedding"])
def test_a_micro_batch_every_sample_of_which_is_refused_names_every_one(backend, model):
    """Labels 9 of 3 classes (refused by TF1's session, by the Keras face on the host) or ids
    past the embedding's 50 rows (refused by TensorFlow; NaN rows on JAX) in every sample of a
    micro-batch: each sample fails alone, so each is named, by its data row."""
    face = backend.make(model)
    first, data = batches(8, 2, 12, sparse=model == "embedding")
    face.step(face.cut(first, 4))  # (a Keras optimizer is built by its first step)
    if model == "mlp":
        data["y"][4:8] = 9
    else:
        data["ids"][4:8, 1] = 60
    before = face.values()
    with pytest.raises(hostavg.HostavgError) as raised:
        face.step(face.cut(data, 4), rows=[np.arange(100, 104), np.arange(104, 108),
                                           np.arange(108, 112)])
    same(face.values(), before)
    assert raised.value.culprit_rows == [104, 105, 106, 107], str(raised.value)
    assert "micro-batch 1 of 3" in str(raised.value), str(raised.value)


def test_a_step_while_another_runs_is_a_step_error(backend):
    class Again:
        """Steps the trainer again from inside its own step, once given its face: refused."""

        face = None

        def on_micro_batch(self, micro):
            if self.face is not None and micro.index == 1:
                self.face.step(self.micro)

    hook = Again()
    face, data = started(backend, hooks=[hook])
    hook.face, hook.micro = face, face.cut(data, SIZES)
    error = raised(face, lambda: face.step(hook.micro), hostavg.StepError)
    assert str(error).startswith("another step of this trainer is running")


def test_a_failing_statistic_is_a_step_error(backend):
    steps = []

    def bad(result):  # a number on the first step, then a division by zero
        steps.append(result.step)
        return 1 / (len(steps) == 1)

    face, data = started(backend, statistics={"bad": bad})
    error = raised(face, lambda: face.step(face.cut(data, SIZES)), hostavg.StepError)
    assert str(error).startswith("statistic 'bad' raised ZeroDivisionError")


def test_a_checkpoint_fit_cannot_write_is_a_step_error(backend, tmp_path):
    class Blocked:
        """Puts a file where fit's checkpoints go, after the first epoch's checkpoint."""

        def on_epoch_end(self, epoch, logs):
            for old in (tmp_path / "run").iterdir():
                old.unlink()
            (tmp_path / "run").rmdir()
            (tmp_path / "run").write_text("in the way")

    face = backend.make()
    with pytest.raises(hostavg.StepError, match=r"cannot write the checkpoint .*is a file, not "
                                                r"a folder"):
        face.fit(batches(5, 1, 64)[0], batch_size=16, micro_batch_size=8, epochs=2,
                 checkpoint_dir=tmp_path / "run", callbacks=[Blocked()], verbose=0)
