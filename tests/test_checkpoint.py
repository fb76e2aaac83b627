"""Checkpoints (hostavg.train.checkpoint): save and restore, the position in samples, and a
damaged, flipped or unwritable file refused naming it before anything changes."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from models import (FIT, FailAt, assert_bitwise, build, dead_pid, each_flip, fit_setup, v1,
                    variables, written)

import hostavg
from hostavg.train import checkpoint
from hostavg.train.checkpoint import CheckpointDir


# --- Resume: the position is samples, so another batch size continues at the right one ---------


def test_a_resume_with_another_batch_size_continues_at_the_next_sample(tmp_path):
    trainer, sess, data = fit_setup()
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer.fit(sess, data, checkpoint_dir=tmp_path, callbacks=[FailAt(2)], **FIT)
    state = trainer.restore(sess, CheckpointDir(tmp_path).latest())
    assert {k: state[k] for k in ("epoch", "batch", "samples", "batch_size")} == {
        "epoch": 0, "batch": 2, "samples": 100, "batch_size": 50}

    trainer, sess, data = fit_setup()
    history = trainer.fit(sess, data, checkpoint_dir=tmp_path, **dict(FIT, batch_size=25, epochs=1))
    # From sample 100 on in batches of 25 (a batch index of 2 read as 2 * 25 trained 50:100 twice).
    assert [s.size for s in history.steps] == [50, 50] + [25] * 6
    assert history.epochs[0]["samples"] == 250

    want, want_sess, want_data = fit_setup()  # the same samples in the same order, by hand
    order = np.random.default_rng([FIT["seed"], 0]).permutation(250)
    for lo, hi in [(0, 50), (50, 100)] + [(a, a + 25) for a in range(100, 250, 25)]:
        batch = {k: v[order[lo:hi]] for k, v in want_data.items()}
        want.step(want_sess, hostavg.split(batch, FIT["micro_batch_size"]))
    assert_bitwise(variables(trainer, sess), variables(want, want_sess))


# --- Variables made from one initial-value tensor are set each to its own value ---------------


def test_variables_made_from_one_initial_value_are_restored_each_to_its_own(tmp_path):
    # load_variables fed each variable's initial value: {t: a's value, t: b's value} is one
    # dict key, so restore and a failed step's rollback gave both variables b's value.
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        t = tf.zeros([3])
        w = tf.Variable(np.ones(3, np.float32), name="w")
        low, high = tf.Variable(t, trainable=False, name="low"), tf.Variable(t, trainable=False,
                                                                            name="high")
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, low.assign_sub(tf.reduce_mean(x, 0)))
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, high.assign_add(tf.reduce_mean(x, 0)))
        trainer = hostavg.Trainer(tf.reduce_mean(tf.reduce_sum(x * w, 1)),
                                  v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    assert {v.op.name for v in trainer.rollback_variables} == {"low", "high"}
    sess = v1.Session(graph=graph)
    sess.run(init)
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    trainer.step(sess, hostavg.split({x: data}, 2))
    before = sess.run({"low": low, "high": high, "w": w})
    assert not np.array_equal(before["low"], before["high"])
    bad = data.copy()
    bad[3, 0] = np.nan
    with pytest.raises(hostavg.HostavgError, match="micro-batch 1 of 2 .*non-finite"):
        trainer.step(sess, hostavg.split({x: bad}, 2))
    for name, value in sess.run({"low": low, "high": high, "w": w}).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    trainer.save(sess, tmp_path / "ckpt.npz")
    trainer.step(sess, hostavg.split({x: data}, 2))
    trainer.restore(sess, tmp_path / "ckpt.npz")
    for name, value in sess.run({"low": low, "high": high, "w": w}).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


# --- Restore checks everything before changing anything ----------------------------------------


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> dict:
    """A checkpoint fit wrote, as its arrays ("meta" decoded)."""
    folder = tmp_path_factory.mktemp("good")
    trainer, sess, data = fit_setup()
    trainer.fit(sess, data, checkpoint_dir=folder, **dict(FIT, epochs=1))
    with np.load(CheckpointDir(folder).latest()) as z:
        arrays = dict(z)
    arrays["meta"] = json.loads(str(arrays["meta"][()]))
    return arrays


def damaged(path, good, change):
    """``good`` with ``change`` made to its arrays, written to ``path``."""
    arrays = {**good, "meta": json.loads(json.dumps(good["meta"]))}  # the metadata copied deep
    change(arrays)
    if not isinstance(arrays["meta"], str):
        arrays["meta"] = json.dumps(arrays["meta"])
    arrays["meta"] = np.array(arrays["meta"])
    np.savez(path, **arrays)
    return path


def fit_state(**changes):
    def change(arrays):
        arrays["meta"]["fit"].update(changes)
    return change


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(meta="{not json"), r"is not a readable hostavg checkpoint \(JSONDecodeError"),
    (lambda a: a.update(meta="[1, 2]"), r"is damaged: its metadata is not hostavg's format 1"),
    (lambda a: a["meta"].pop("variables"), r"is damaged: its metadata's variables are not"),
    (lambda a: a["meta"]["variables"].update({"logits/bias": [[3], 7]}),
     r"is damaged: its metadata's variables are not"),
    (lambda a: a.pop("var/logits/bias"), r"is not a readable .* \(KeyError: .*logits/bias"),
    (lambda a: a.update({"var/logits/bias": np.zeros(4, np.float32)}),
     r"is damaged: \['logits/bias' is \(4,\) <f4, its metadata says \(3,\) <f4\]"),
    (fit_state(epoch=-1), r"is damaged: fit's state has epoch -1"),
    (fit_state(batch_size=0, seed="7"), r"is damaged: fit's state has batch_size 0, seed '7'"),
    (lambda a: a["meta"]["fit"].pop("samples"), r"fit's state must hold exactly \['batch', "),
    (fit_state(history="{}"), r"is damaged: fit's history: not a History's JSON \(KeyError"),
    (fit_state(history='{"steps": [[1]], "epochs": [], "stopped": null}'),
     r"fit's history: not a History's JSON \(TypeError"),
])
def test_a_damaged_checkpoint_changes_nothing_and_says_so(tmp_path, good_checkpoint, change, match):
    path = damaged(tmp_path / "damaged.npz", good_checkpoint, change)
    trainer, sess, data = fit_setup()
    before = variables(trainer, sess)
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.restore(sess, path)
    assert_bitwise(variables(trainer, sess), before)
    # fit refuses it the same way, before training.
    (tmp_path / "dir").mkdir()
    os.replace(path, tmp_path / "dir" / "ckpt-0000000009.npz")
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.fit(sess, data, checkpoint_dir=tmp_path / "dir", **FIT)
    assert_bitwise(variables(trainer, sess), before)


# --- Files: a killed writer's temporaries, every flipped bit ----------------------------------


def test_temporaries_of_killed_writers_are_removed_by_the_next_save(tmp_path):
    trainer, sess, data = fit_setup()
    folder = CheckpointDir(tmp_path)
    stale = tmp_path / f".ckpt-0000000007.npz.{dead_pid()}.x1y2.tmp"
    live = tmp_path / f".ckpt-0000000008.npz.{os.getppid()}.x1y2.tmp"  # a running writer
    other = tmp_path / f".notes.txt.{dead_pid()}.x1y2.tmp"  # not ours
    for path in (stale, live, other):
        path.write_bytes(b"half-written")
    folder.save(1, lambda path: trainer.save(sess, path))
    assert not stale.exists() and live.exists() and other.exists()
    assert [p.name for p in folder.checkpoints()] == ["ckpt-0000000001.npz"]


def read_checkpoint(path, forms):
    stored, fit = checkpoint.read(path, forms)
    return {k: v.tobytes() + str(v.dtype).encode() for k, v in stored.items()}, fit


def test_every_flipped_bit_of_a_checkpoint_is_refused_naming_it_or_loads_exactly(written, tmp_path):
    # 30 of 10,384 flips escaped as NotImplementedError ("That compression method is not
    # supported"), RuntimeError ("File ... is encrypted") or tokenize.TokenError.
    ckpt, _ = written
    good = ckpt.read_bytes()
    path = tmp_path / "ckpt-0000000001.npz"
    path.write_bytes(good)
    with np.load(path) as z:
        names = [k[len("var/"):] for k in z.files if k.startswith("var/")]
        forms = {n: (z[f"var/{n}"].shape, z[f"var/{n}"].dtype) for n in names}
    refused, exact, wrong = each_flip(good, path, lambda p: read_checkpoint(p, forms), seed=9)
    assert not wrong, wrong[:5]
    assert refused > 500 and exact > 0


# --- Paths that are not paths, or cannot be written ---------------------------------------------


def linear():
    model = build()
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, trainer, sess


def test_save_to_none_or_an_unwritable_place_names_the_path_not_a_temporary(tmp_path):
    _, trainer, sess = linear()
    with pytest.raises(hostavg.HostavgError, match=r"^a checkpoint's path must be a file name "
                                                   r"\(str or os.PathLike\), got None$"):
        trainer.save(sess, None)
    with pytest.raises(hostavg.HostavgError, match=r"^cannot write the checkpoint '/proc/x.npz' "
                       r"\(No such file or directory\); name a file in a folder that can be "
                       r"written$"):
        trainer.save(sess, "/proc/x.npz")
    with pytest.raises(hostavg.HostavgError, match=r"^a checkpoint's path must be a file name"):
        trainer.restore(sess, None)
    (tmp_path / "f").write_text("a file")
    with pytest.raises(hostavg.HostavgError, match=r"^cannot write the checkpoint "
                                                   r"'.*/f/c.npz': '.*/f' is a file, not a folder$"):
        trainer.save(sess, tmp_path / "f" / "c.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
