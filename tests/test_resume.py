"""fit's resume (hostavg.train.loop.resume): a run killed before its first checkpoint, the start
checkpointed, and models whose random state no checkpoint holds."""

import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from models import ENV, FailAt, v1

import hostavg
from hostavg.train.checkpoint import CheckpointDir


HERE = Path(__file__).parent


def resume_script(folder, out, kill_at=0):
    return subprocess.run([sys.executable, str(HERE / "resume_script.py"), str(folder), str(out),
                           str(kill_at)], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_resumes_its_record(tmp_path):
    # The rerun was refused: "Record: the folder ... already holds 3 steps at or after step 1,
    # the first this run writes (1, 2, 3): another run's".
    straight = resume_script(tmp_path / "straight", tmp_path / "straight.npz")
    assert straight.returncode == 0, straight.stderr
    killed = resume_script(tmp_path / "run", tmp_path / "killed.npz", kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert hostavg.load_record(tmp_path / "run" / "rec").steps == [1, 2, 3]
    resumed = resume_script(tmp_path / "run", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.split() == straight.stdout.split()  # step 1 to 6 again
    want, got = (dict(np.load(tmp_path / f"{n}.npz")) for n in ("straight", "resumed"))
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    a, b = (hostavg.load_record(tmp_path / n / "rec") for n in ("straight", "run"))
    assert a.steps == b.steps == list(range(1, 7))
    for step in a.steps:
        assert a[step].loss == b[step].loss
        for name, value in a[step].mean.items():
            np.testing.assert_array_equal(b[step].mean[name], value, err_msg=f"{step} {name}")


def linear(dropout=False, record=None):
    """A small dense model (with dropout) trained by SGD, an initialised session and data."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.Variable(np.full((4, 1), 0.5, np.float32), name="w")
        h = tf.nn.dropout(x, rate=0.5) if dropout else x
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - 1.0))
        hooks = [] if record is None else [hostavg.hooks.Record(record)]
        trainer = hostavg.Trainer(loss, v1.train.GradientDescentOptimizer(0.1), hooks=hooks)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    data = {x: np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)}
    return trainer, sess, data


FIT = dict(batch_size=10, micro_batch_size=5, epochs=1, seed=3, progress=False)


def test_the_start_is_checkpointed_before_the_first_step(tmp_path):
    trainer, sess, data = linear()
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer.fit(sess, data, checkpoint_dir=tmp_path, callbacks=[FailAt(1)],
                    **dict(FIT, epochs=2))
    names = [p.name for p in CheckpointDir(tmp_path).checkpoints()]
    assert names == ["ckpt-0000000000.npz", "ckpt-0000000001.npz"]
    state = trainer.restore(sess, tmp_path / names[0])
    assert (state["epoch"], state["batch"], state["samples"], state["seed"]) == (0, 0, 0, 3)


def test_resuming_a_model_with_stateful_random_ops_warns_naming_them(tmp_path):
    # A TF1 model with tf.nn.dropout resumed 0.10 away from an uninterrupted run, silently.
    trainer, sess, data = linear(dropout=True)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer.fit(sess, data, checkpoint_dir=tmp_path, callbacks=[FailAt(2)], **FIT)
    trainer, sess, data = linear(dropout=True)
    with pytest.warns(hostavg.ResumeWarning, match=r"^fit resumed from .*ckpt-0000000002.npz, but "
                      r"the model runs stateful random ops \(tf.nn.dropout \('dropout/"
                      r"random_uniform/RandomUniform:0'\)\) whose state lives in the session, "
                      r"which no checkpoint holds: .* will not end with its weights bit for bit\. "
                      r"Stateless random ops \(tf\.random\.stateless_\*\) seeded by the global "
                      r"step resume exactly$") as warned:
        trainer.fit(sess, data, checkpoint_dir=tmp_path, **FIT)
    assert [w.filename for w in warned if w.category is hostavg.ResumeWarning] == [__file__]


def test_resuming_a_model_without_random_ops_says_nothing_and_ends_bit_for_bit(tmp_path):
    straight, sess0, data0 = linear()
    straight.fit(sess0, data0, **FIT)
    trainer, sess, data = linear()
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        trainer.fit(sess, data, checkpoint_dir=tmp_path, callbacks=[FailAt(2)], **FIT)
    trainer, sess, data = linear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(sess, data, checkpoint_dir=tmp_path, **FIT)
    got, want = (dict(zip([v.op.name for v in t.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)],
                          s.run(t.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES))))
                 for t, s in ((trainer, sess), (straight, sess0)))
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
