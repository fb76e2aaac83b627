"""fit: batches, weighting, data sources, history, callbacks, checkpoints and resume; its
arguments and data checked before an epoch trains."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from models import ENV, FIT, AfterStep, FailAt, assert_bitwise, build, fit_setup, tf1, variables

import hostavg
from hostavg.cli import models
from hostavg.train.checkpoint import CheckpointDir
from hostavg.train.sources import ArraySource

v1 = tf.compat.v1
N = 250  # batches of 96: 96, 96 and a short 58


def setup(seed=1, hidden=(16,), **trainer_kw):
    model = models.mlp(10, list(hidden), 3, seed=seed)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), **trainer_kw)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, trainer, sess


def data(model, n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10)).astype(np.float32)
    return {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1)}


def weights(model, sess):
    with model.graph.as_default():
        variables = v1.global_variables()
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_fit_equals_a_hand_written_loop_of_steps_with_a_short_last_batch():
    model, trainer, sess = setup()
    d = data(model)
    history = trainer.fit(sess, d, batch_size=96, micro_batch_size=32, epochs=2,
                          shuffle=False, progress=False)
    want_model, want_trainer, want_sess = setup()
    losses = []
    for _ in range(2):
        for start in range(0, N, 96):
            batch = {k: v[start:start + 96] for k, v in d.items()}
            batch = {want_model.x: batch[model.x], want_model.y: batch[model.y]}
            losses.append(want_trainer.step(want_sess, hostavg.split(batch, 32)).loss)
    assert_bitwise_equal(weights(model, sess), weights(want_model, want_sess))
    assert [s.loss for s in history.steps] == losses
    assert [s.size for s in history.steps] == [96, 96, 58] * 2
    assert [s.step for s in history.steps] == list(range(1, 7))
    assert history.samples == 2 * N and history.steps[-1].epoch == 1
    epoch0 = history.epochs[0]
    assert epoch0["samples"] == N and epoch0["steps"] == 3
    assert epoch0["loss"] == pytest.approx(
        sum(s.loss * s.size for s in history.steps[:3]) / N, rel=1e-12)


def test_micro_batches_on_the_trainer_cut_each_batch_into_k_as_split_does():
    """micro_batches=3: batches of 96 in 32 each, the short 58 in 20, 19, 19: bit for bit the
    steps over hostavg.split(batch, micro_batches=3); fit's own micro_batch_size wins."""
    model, trainer, sess = setup(micro_batches=3)
    d = data(model)
    history = trainer.fit(sess, d, batch_size=96, shuffle=False, progress=False,
                          validation_data=d)
    want_model, want_trainer, want_sess = setup()
    sizes = []
    for start in range(0, N, 96):
        rows = slice(start, start + 96)
        batch = {want_model.x: d[model.x][rows], want_model.y: d[model.y][rows]}
        result = want_trainer.step(want_sess, hostavg.split(batch, micro_batches=3))
        sizes.append([m.size for m in result.micro])
    assert sizes == [[32, 32, 32], [32, 32, 32], [20, 19, 19]]
    assert [len(s.micro_norms) for s in history.steps] == [3, 3, 3]
    assert_bitwise_equal(weights(model, sess), weights(want_model, want_sess))
    assert "val_loss" in history.history
    small = {model.x: d[model.x][:10], model.y: d[model.y][:10]}
    assert trainer.check(sess, small).micro_batches == 3
    history = trainer.fit(sess, d, batch_size=96, micro_batch_size=48, progress=False)
    assert [len(s.micro_norms) for s in history.steps] == [2, 2, 2]
    with pytest.raises(hostavg.HostavgError, match=r"^give micro_batch_size or micro_batches, "
                                                   r"not both; got micro_batch_size=4, "
                                                   r"micro_batches=2$"):
        setup(micro_batch_size=4, micro_batches=2)


def test_an_endless_dataset_without_steps_per_epoch_is_refused_before_anything_changes():
    model, trainer, sess = setup(micro_batch_size=32)
    d = data(model)
    endless = tf.data.Dataset.from_tensor_slices({"x": d[model.x], "y": d[model.y]}).repeat()
    before = weights(model, sess)
    with pytest.raises(hostavg.HostavgError, match=r"^the data never ends \(a dataset of infinite "
                                                   r"cardinality.*; pass steps_per_epoch="):
        trainer.fit(sess, endless, inputs={"x": model.x, "y": model.y}, batch_size=96,
                    progress=False)
    assert_bitwise_equal(weights(model, sess), before)  # the global step among them
    history = trainer.fit(sess, endless, inputs={"x": model.x, "y": model.y}, batch_size=96,
                          steps_per_epoch=4, epochs=2, progress=False)
    assert [s.size for s in history.steps] == [96] * 8


def test_drop_remainder_and_shuffle_seed():
    model, trainer, sess = setup()
    history = trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32,
                          drop_remainder=True, seed=3, progress=False)
    assert [s.size for s in history.steps] == [96, 96]
    runs = []
    for seed in (3, 3, 4):
        model, trainer, sess = setup()
        trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=2,
                    seed=seed, progress=False)
        runs.append(weights(model, sess))
    assert_bitwise_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0]["logits/kernel"], runs[2]["logits/kernel"])


def test_iterable_callable_and_dataset_sources_equal_the_dict():
    model, trainer, sess = setup()
    d = data(model)
    trainer.fit(sess, d, batch_size=96, micro_batch_size=32, epochs=2, shuffle=False,
                progress=False)
    want = weights(model, sess)
    batches = [{k: v[s:s + 96] for k, v in d.items()} for s in range(0, N, 96)]

    for source in (lambda m: batches_for(m, batches, model), lambda m: lambda: iter(batches_for(m, batches, model))):
        m, t, s = setup()
        t.fit(s, source(m), batch_size=96, micro_batch_size=32, epochs=2, progress=False)
        assert_bitwise_equal(weights(m, s), want)

    m, t, s = setup()
    dataset = tf.data.Dataset.from_tensor_slices({"x": d[model.x], "y": d[model.y]})
    t.fit(s, dataset, inputs={"x": m.x, "y": m.y}, batch_size=96, micro_batch_size=32,
          epochs=2, shuffle=False, progress=False)
    for name, value in weights(m, s).items():  # tf.data batches slices: same samples, same order
        np.testing.assert_allclose(value, want[name], rtol=1e-6, atol=1e-7, err_msg=name)

    m, t, s = setup()
    with pytest.raises(hostavg.HostavgError, match="one-shot iterator"):
        t.fit(s, iter(batches_for(m, batches, model)), batch_size=96, micro_batch_size=32,
              epochs=2, progress=False)


def batches_for(m, batches, model):
    return [{m.x: b[model.x], m.y: b[model.y]} for b in batches]


def test_validation_metrics_history_table_and_callbacks():
    model, trainer, sess = setup()
    calls = []

    class Recorder(hostavg.Callback):
        def on_applied(self, result):
            calls.append(("step", result.step, result.size))

        def on_epoch_end(self, epoch, logs):
            calls.append(("epoch", epoch, sorted(logs)))

        def on_train_end(self, history):
            calls.append(("end", len(history.steps)))

    val = data(model, n=40, seed=9)
    history = trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=2,
                          validation_data=val, metrics={"accuracy": model.accuracy},
                          callbacks=[Recorder()], progress=False)
    keys = ["epoch", "loss", "samples", "steps", "val_accuracy", "val_loss"]
    assert calls == [("step", 1, 96), ("step", 2, 96), ("step", 3, 58), ("epoch", 0, keys),
                     ("step", 4, 96), ("step", 5, 96), ("step", 6, 58), ("epoch", 1, keys),
                     ("end", 6)]
    assert history.epochs[-1]["val_loss"] == pytest.approx(
        trainer.evaluate(sess, val, batch_size=40)["loss"], rel=1e-6)
    table = history.to_pandas()
    # every per-step and per-micro-batch quantity of the schema (issue 35: the stack-only tests,
    # GSNR and the clip hooks' norms were missing)
    assert list(table.columns) == ["epoch", "step", "loss", "size", "samples", "grad_norm", "g2",
                                   "trace_sigma", "b_simple", "norm_test", "inner_product_test",
                                   "orthogonality_test", "gsnr", "learning_rate",
                                   "grad_norm_before_clip", "hessian_trace",
                                   "hessian_top_eigenvalue", "sharpness", "alpha", "distance",
                                   "update_norm", "micro_sizes", "micro_losses",
                                   "micro_norms_before_clip", "micro_norms", "cosines", "dropped",
                                   "nonfinite_rows"]
    assert table["samples"].iloc[-1] == 2 * N
    assert list(history.to_pandas("epochs")["val_accuracy"]) == [
        e["val_accuracy"] for e in history.epochs]


def test_early_stopping_and_stop_training_end_cleanly():
    model, trainer, sess = setup()
    stopper = hostavg.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)
    history = trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=5,
                          callbacks=[stopper], progress=False)
    assert len(history.epochs) == 2 and "early stopping: loss has not improved" in history.stopped

    class StopAt(AfterStep):
        def after(self, step):
            if step == 2:
                raise hostavg.StopTraining("enough")

    model, trainer, sess = setup()
    history = trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=5,
                          callbacks=[StopAt()], progress=False)
    assert len(history.steps) == 2 and history.stopped == "enough"
    with pytest.raises(hostavg.HostavgError, match=r"monitors 'val_loss', which the epoch logs lack"):
        trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32,
                    callbacks=[hostavg.EarlyStopping()], progress=False)


def test_on_step_end_is_deprecated_and_still_called_after_each_step_fit_counted(tmp_path):
    """The callback method of earlier versions warns, naming on_applied, where fit is called; it
    still runs once the step is in the History and checkpointed, and may stop training."""
    model, trainer, sess = setup()
    calls = []

    class StopAt:
        def on_step_end(self, step, result):
            calls.append((step, result.step, sorted(p.name for p in tmp_path.glob("ckpt-*"))[-1]))
            if step == 2:
                raise hostavg.StopTraining("enough")

    with pytest.warns(DeprecationWarning, match=r"^StopAt\.on_step_end\(step, result\) is "
                                                r"deprecated; define on_applied\(result\)") as warned:
        history = trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=5,
                              callbacks=[StopAt()], progress=False, checkpoint_dir=tmp_path,
                              checkpoint_every=1)
    assert [w.filename for w in warned] == [__file__]
    assert len(history.steps) == 2 and history.stopped == "enough"
    assert calls == [(1, 1, "ckpt-0000000001.npz"), (2, 2, "ckpt-0000000002.npz")]


@pytest.mark.parametrize("kwargs,match", [
    ({"batch_size": 32, "micro_batch_size": 64}, r"micro_batch_size \(64\) is larger than batch_size \(32\)"),
    ({"batch_size": 0, "micro_batch_size": 1}, "batch_size must be an integer >= 1, got 0"),
    ({"batch_size": 8, "micro_batch_size": 4, "epochs": 0}, "epochs must be an integer >= 1, got 0"),
    ({"batch_size": 8, "micro_batch_size": 4, "progress": "yes"}, "progress must be True, False, "),
    ({"batch_size": 8, "micro_batch_size": 4, "callbacks": [object()]}, "has none of the methods"),
])
def test_fit_argument_errors(kwargs, match):
    model, trainer, sess = setup()
    before = weights(model, sess)
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.fit(sess, data(model), **kwargs)
    assert_bitwise_equal(weights(model, sess), before)


def test_save_restore_round_trip_and_a_different_model_is_refused(tmp_path):
    model, trainer, sess = setup()
    trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, progress=False)
    trainer.save(sess, tmp_path / "a.npz")
    saved = weights(model, sess)
    trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, progress=False)
    assert trainer.restore(sess, tmp_path / "a.npz") is None
    assert_bitwise_equal(weights(model, sess), saved)

    other, other_trainer, other_sess = setup(hidden=(8,))
    before = weights(other, other_sess)
    with pytest.raises(hostavg.HostavgError, match=r"written by a different model: missing \[\], "
                                                   r"unexpected \[\], mismatched \['hidden0/kernel': \(10, 16\) "
                                                   r"float32 in the checkpoint, \(10, 8\) float32 in "
                                                   r"the model, .* and 6 more"):
        other_trainer.restore(other_sess, tmp_path / "a.npz")
    assert_bitwise_equal(weights(other, other_sess), before)
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 half a zip")
    with pytest.raises(hostavg.HostavgError, match="is not a readable hostavg checkpoint"):
        trainer.restore(sess, tmp_path / "junk.npz")


def test_checkpoint_dir_keeps_the_newest_and_ignores_unfinished_files(tmp_path):
    model, trainer, sess = setup()
    ckpt = tmp_path / "ck"
    trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=2,
                checkpoint_dir=ckpt, checkpoint_every=1, keep_checkpoints=2, progress=False)
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-0000000005.npz", "ckpt-0000000006.npz"]
    (ckpt / ".ckpt-0000000009.npz.abc.tmp").write_bytes(b"half-written")
    assert CheckpointDir(ckpt).latest().name == "ckpt-0000000006.npz"
    # Started again on a finished run: nothing more to do, the history comes back.
    history = trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=2,
                          checkpoint_dir=ckpt, progress=False)
    assert len(history.steps) == 6 and sess.run(trainer.global_step) == 6


def run_script(*args, **kw):
    script = Path(__file__).with_name("fit_script.py")
    return subprocess.Popen([sys.executable, str(script), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            **kw)


def wait_for_step(proc, step, timeout=60):
    deadline = time.time() + timeout
    for line in proc.stdout:
        if line.strip() == f"step {step}":
            return
        assert time.time() < deadline, "the fit script did not reach the step in time"
    raise AssertionError(f"the fit script ended before step {step}: rc {proc.wait()}")


@pytest.mark.slow
def test_killed_and_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path):
    straight = run_script(tmp_path / "straight", tmp_path / "straight.npz")
    killed = run_script(tmp_path / "resumed", tmp_path / "unused.npz", 0.2)
    termed = run_script(tmp_path / "termed", tmp_path / "unused2.npz", 0.2)
    wait_for_step(killed, 7)
    killed.kill()  # SIGKILL: no chance to clean up
    wait_for_step(termed, 4)
    termed.send_signal(signal.SIGTERM)
    assert termed.wait(60) == 128 + signal.SIGTERM
    # SIGTERM checkpoints the last completed step on the way out.
    assert CheckpointDir(tmp_path / "termed").latest().name >= "ckpt-0000000004.npz"
    assert killed.wait(60) == -signal.SIGKILL
    resumed = run_script(tmp_path / "resumed", tmp_path / "resumed.npz")
    resumed2 = run_script(tmp_path / "termed", tmp_path / "termed.npz")
    for proc in (straight, resumed, resumed2):
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out
    want = dict(np.load(tmp_path / "straight.npz"))
    assert want["global_step"] == 30
    for name in ("resumed.npz", "termed.npz"):
        assert_bitwise_equal(dict(np.load(tmp_path / name)), want)


# --- Errors inside fit point at the data, and keep what came before ---------------------------


def test_an_error_inside_fit_names_rows_epoch_batch_and_global_step_and_keeps_the_history():
    model, trainer, sess = setup()
    d = data(model)
    order = np.random.default_rng([5, 0]).permutation(N)  # fit's order of epoch 0 with seed 5
    bad_row = int(order[96 + 50])  # in batch 1, micro-batch 12
    d[model.x] = d[model.x].copy()
    d[model.x][bad_row, 3] = np.nan
    seen = []

    class Rows:
        def on_applied(self, result):
            seen.append([m.rows for m in result.micro])

    with pytest.raises(hostavg.HostavgError) as raised:
        trainer.fit(sess, d, batch_size=96, micro_batch_size=4, epochs=2, seed=5,
                    callbacks=[Rows()], progress=False)
    error = raised.value
    batch, micro = 1, 12
    rows = order[batch * 96 + micro * 4:batch * 96 + micro * 4 + 4]
    assert str(error).startswith(
        f"fit, epoch 1/2, batch {batch + 1}/3, global step {batch}: step, micro-batch {micro} of "
        f"24 (samples {micro * 4}:{micro * 4 + 4}, data rows {rows.tolist()}): non-finite "
        f"gradients in 'hidden0/kernel'"), str(error)
    assert bad_row in error.rows
    assert len(error.history.steps) == batch and error.history.steps[-1].step == batch
    for got, start in zip(seen, range(0, N, 96)):  # each micro-batch's rows of the user's data
        np.testing.assert_array_equal(np.concatenate(got), order[start:start + 96])
    assert sess.run(trainer.global_step) == batch


def test_any_exception_leaving_fit_carries_the_history_and_a_note_where_it_happened():
    class Boom:
        def on_micro_batch(self, micro):
            if micro.step == 3:
                raise KeyError("boom")

    model = models.mlp(10, [16], 3, seed=1)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), hooks=[Boom()])
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    with pytest.raises(KeyError) as raised:
        trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=2,
                    shuffle=False, progress=False)
    assert [s.step for s in raised.value.history.steps] == [1, 2]
    assert raised.value.__notes__[-1] == "hostavg: in fit, epoch 1/2, batch 3/3, global step 2"


def test_a_dataset_source_knows_its_rows():
    model, trainer, sess = setup()
    d = data(model)
    rows = []

    class Rows:
        def on_applied(self, result):
            rows.extend(r for m in result.micro for r in m.rows)

    dataset = tf.data.Dataset.from_tensor_slices({"x": d[model.x], "y": d[model.y]})
    trainer.fit(sess, dataset, inputs={"x": model.x, "y": model.y}, batch_size=96,
                micro_batch_size=32, seed=0, callbacks=[Rows()], progress=False)
    assert sorted(rows) == list(range(N)) and rows != list(range(N))  # shuffled, each row once
    trainer.fit(sess, [{model.x: d[model.x][:96], model.y: d[model.y][:96]}], batch_size=96,
                micro_batch_size=32, callbacks=[type("Check", (), {
                    "on_applied": lambda self, result: rows.append(result.micro[0].rows)})()],
                progress=False)
    assert rows[-1] is None  # batches given as feed dicts: fit can't tell the rows


def test_a_resumed_fit_continues_its_record(tmp_path):
    rec, ckpt = tmp_path / "rec", tmp_path / "ck"

    def run(stop=None):
        model = models.mlp(10, [16], 3, seed=1)
        with model.graph.as_default():
            trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01),
                                      hooks=[hostavg.hooks.Record(rec, micro=False)])
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=model.graph)
        sess.run(init)
        return trainer.fit(sess, data(model), batch_size=96, micro_batch_size=32, epochs=2,
                           seed=3, checkpoint_dir=ckpt, checkpoint_every=2, progress=False,
                           callbacks=[FailAt(stop)] if stop else [])

    with pytest.raises(RuntimeError, match="stopped on purpose"):
        run(stop=5)
    assert hostavg.load_record(rec).steps == [1, 2, 3, 4, 5]
    CheckpointDir(ckpt).latest().unlink()  # as if killed: the newest checkpoint is of step 4
    assert CheckpointDir(ckpt).latest().name == "ckpt-0000000004.npz"
    history = run()
    record = hostavg.load_record(rec)
    assert record.steps == [1, 2, 3, 4, 5, 6]
    assert [record[s].loss for s in record.steps] == [s.loss for s in history.steps]


def test_train_begin_moves_fit_back_to_the_epoch_a_restoring_hook_returns():
    # One piece of fit alone: a hook that restored a backup of epoch 1's start undoes what
    # the History held from there on, and the position starts that epoch's pass afresh.
    from types import SimpleNamespace
    from hostavg.train.loop import FitState, train_begin
    state = FitState(epoch=3, data_pass=4, batch=2, samples=64)
    state.history.steps = [SimpleNamespace(epoch=e) for e in (0, 1, 2, 3)]
    state.history.epochs = [{"epoch": e} for e in (0, 1, 2)]
    train_begin({"on_train_begin": [lambda: None, lambda: 1]}, state)
    assert (state.epoch, state.data_pass, state.batch, state.samples) == (1, 1, 0, 0)
    assert [s.epoch for s in state.history.steps] == [0]
    assert state.history.epochs == [{"epoch": 0}]


# --- fit: no silent empty runs; None where a list is expected -----------------------------------


@pytest.mark.parametrize("make,kw,match", [
    (lambda d: {k: v[:0] for k, v in d.items()}, {},
     r"^data holds 0 samples, so an epoch has no batch of batch_size 50; fit needs at least one"),
    (lambda d: {k: v[:30] for k, v in d.items()}, {"drop_remainder": True},
     r"^data holds 30 samples, so an epoch has no batch of batch_size 50 \(drop_remainder\)"),
    (lambda d: [], {}, r"^epoch 0 trained no step: the data gave 0 batches; fit needs at least one"),
    (lambda d: [{k: v[:30] for k, v in d.items()}], {"drop_remainder": True},
     r"^epoch 0 trained no step: the data gave 1 batches, every one shorter than batch_size and "
     r"dropped \(drop_remainder\)"),
    (lambda d: tf.data.Dataset.from_tensor_slices({"x": np.zeros((0, 10), np.float32)}),
     {"inputs": "x"}, r"^data holds 0 samples"),
])
def test_fit_refuses_data_that_gives_no_step(make, kw, match):
    trainer, sess, data = fit_setup()
    before = variables(trainer, sess)
    if kw.get("inputs") == "x":
        kw = {"inputs": {"x": trainer.graph.get_tensor_by_name("x:0")}}
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.fit(sess, make(data), **dict(FIT, **kw))
    assert_bitwise(variables(trainer, sess), before)


def test_none_for_hooks_and_callbacks_means_none_and_a_lone_object_is_refused():
    trainer, sess, data = fit_setup()
    history = trainer.fit(sess, data, callbacks=None, **dict(FIT, epochs=1))
    assert len(history.steps) == 5
    with pytest.raises(hostavg.HostavgError, match=r"^callbacks must be a list of objects with "
                       r"on_micro_batch or on_step or on_step_batch or on_applied_batch or "
                       r"on_applied or wants_update_ratios or frozen or skip_samples or "
                       r"on_resume or on_train_begin or on_epoch_begin or on_batch_begin or "
                       r"on_batch_end or on_epoch_end or on_train_end or close or on_step_end "
                       r"\(or None\), got "
                       r"<hostavg.train.callbacks.EarlyStopping"):
        trainer.fit(sess, data, callbacks=hostavg.EarlyStopping(), **FIT)
    model = build()
    with model.graph.as_default():
        assert hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.1), hooks=None,
                               watch_outliers=False, diagnose=False).hooks == ()
        with pytest.raises(hostavg.HostavgError, match=r"^hooks must be a list of objects with "
                           r"on_micro_batch or on_step or on_step_batch or on_applied_batch or "
                           r"on_applied or wants_update_ratios or frozen or skip_samples or "
                           r"on_resume or on_train_begin or on_epoch_begin or on_batch_begin or "
                           r"on_batch_end or on_epoch_end or on_train_end or close or on_step_end "
                           r"\(or None\), got "
                           r"<hostavg.train.hooks.SkipNonFinite"):
            hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.1),
                            hooks=hostavg.hooks.SkipNonFinite())


def test_misuse_gets_one_clear_error():
    with pytest.raises(hostavg.HostavgError, match=r"^split takes a dict \{key: "
                       r"array\} or a tuple \(x, y\), got list"):
        hostavg.split([np.zeros(4)], 2)
    model, other = build(), build()
    with model.graph.as_default():
        foreign = other.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)[0]
        with pytest.raises(hostavg.HostavgError, match=r"^var_list holds variable 'hidden/kernel:0' "
                           r"of another graph than the loss's"):
            hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.1), var_list=[foreign])
    trainer, sess, data = fit_setup()
    with trainer.graph.as_default():
        graph_mode = tf.data.Dataset.from_tensor_slices({"x": np.zeros((4, 10), np.float32)})
    with pytest.raises(hostavg.HostavgError, match=r"^fit reads a tf.data.Dataset eagerly, but "
                       r"this one is in graph mode"):
        trainer.fit(sess, graph_mode, inputs={"x": trainer.graph.get_tensor_by_name("x:0")},
                    **FIT)


# --- fit's arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 1.5, "abc", True])
def test_fit_refuses_a_seed_that_is_no_integer_at_least_0(tf1, seed, tmp_path):
    # -1, 1.5 and "abc" reached NumPy raw; -1 with shuffle=False trained and wrote a checkpoint
    # that the next fit called damaged.
    model, trainer, sess, feed = tf1
    before = sess.run(trainer.global_step)
    for shuffle in (True, False):
        with pytest.raises(hostavg.HostavgError, match=rf"^seed must be an integer >= 0, got "
                                                       rf"{repr(seed).replace('.', '[.]')}$"):
            trainer.fit(sess, feed, batch_size=10, micro_batch_size=5, seed=seed,
                        shuffle=shuffle, progress=False, checkpoint_dir=tmp_path)
    assert sess.run(trainer.global_step) == before and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,value", [("shuffle", "False"), ("drop_remainder", "False"),
                                        ("shuffle", 0), ("drop_remainder", None)])
def test_fit_refuses_flags_that_are_not_bools(tf1, name, value):
    # shuffle="False" and drop_remainder="False" were taken as True.
    model, trainer, sess, feed = tf1
    before = sess.run(trainer.global_step)
    with pytest.raises(hostavg.HostavgError, match=rf"^{name} must be True or False, got "
                                                   rf"{value!r}$"):
        trainer.fit(sess, feed, batch_size=10, micro_batch_size=5, progress=False,
                    **{name: value})
    assert sess.run(trainer.global_step) == before


@pytest.mark.parametrize("progress", [1, "False"])
def test_fit_refuses_a_progress_that_is_no_bool_nor_a_mode(tf1, progress):
    model, trainer, sess, feed = tf1
    with pytest.raises(hostavg.HostavgError, match=rf"^progress must be True, False, 'always', "
                                                   rf"'epoch' or 'auto', got {progress!r}$"):
        trainer.fit(sess, feed, batch_size=10, micro_batch_size=5, progress=progress)


@pytest.mark.parametrize("verbose", [3, "1", 1.0])
def test_fit_refuses_a_verbose_keras_does_not_know_on_the_tf1_face_too(tf1, verbose):
    model, trainer, sess, feed = tf1
    with pytest.raises(hostavg.HostavgError,
                       match=rf"^verbose must be 'auto', 0, 1 or 2, got {verbose!r}$"):
        trainer.fit(sess, feed, batch_size=10, micro_batch_size=5, verbose=verbose)


@pytest.mark.parametrize("verbose,shown", [(0, ""), (2, "epoch 1/1"), ("auto", "epoch 1/1")])
def test_tf1_fit_shows_what_verbose_asks_unless_progress_is_given(tf1, capsys, verbose, shown):
    model, trainer, sess, feed = tf1
    trainer.fit(sess, feed, batch_size=10, micro_batch_size=5, verbose=verbose)
    assert shown in capsys.readouterr().out and (shown or not capsys.readouterr().out)
    trainer.fit(sess, feed, batch_size=10, micro_batch_size=5, verbose=verbose, progress=False)
    assert capsys.readouterr().out == ""


def test_the_tf1_bar_shows_the_last_gradient_norm_and_the_running_noise_scale(tf1, capsys):
    model, trainer, sess, feed = tf1
    history = trainer.fit(sess, feed, batch_size=10, micro_batch_size=5, epochs=2,
                          progress="always", seed=0)
    bars = [line.split("\r")[-1] for line in capsys.readouterr().err.split("\n") if line]
    assert [b.split(":")[0] for b in bars] == ["epoch 1/2", "epoch 2/2"], bars
    noise = hostavg.NoiseScale()
    for epoch, bar in zip((0, 1), bars):
        last = [s for s in history.steps if s.epoch == epoch]
        for s in last:  # every step so far, over epochs: a running estimate
            noise.update(hostavg.stats.NoiseScaleEstimate(s.g2, s.trace_sigma, s.b_simple))
        assert f"grad_norm={last[-1].grad_norm:.4g}" in bar, bar
        assert f"B_simple={noise.b_simple:.4g}" in bar and "loss=" in bar, bar
        assert "samples=" not in bar and "steps=" not in bar  # the bar says them: 1/1 steps


def test_fit_and_check_take_the_trainers_micro_batch_size_and_need_one(tf1):
    model, trainer, sess, feed = tf1
    with pytest.raises(hostavg.HostavgError, match=r"^fit needs micro_batch_size: pass it to fit, "
                                                   r"or micro_batch_size or micro_batches to the "
                                                   r"trainer"):
        trainer.fit(sess, feed, batch_size=10, verbose=0)
    with pytest.raises(hostavg.HostavgError, match=r"^check needs micro_batch_size"):
        trainer.check(sess, feed)
    trainer.micro_batch_size = 5
    history = trainer.fit(sess, feed, batch_size=10, verbose=0)
    assert [len(s.micro_norms) for s in history.steps] == [2, 2]
    assert trainer.check(sess, feed).ok
    trainer.micro_batch_size, trainer.micro_batches = None, 5
    history = trainer.fit(sess, feed, batch_size=10, verbose=0)
    assert [len(s.micro_norms) for s in history.steps] == [5, 5]


def test_array_source_refuses_a_shuffle_that_is_no_bool():
    # The Keras face's fit cuts its arrays with ArraySource.
    with pytest.raises(hostavg.HostavgError, match=r"^shuffle must be True or False, got 'no'$"):
        ArraySource((np.zeros((4, 2)), np.zeros(4)), 2, "no")


# --- fit checks what it is given before an epoch trains (item 13) -------------------------------


@pytest.mark.parametrize("case,match", [
    # Found after a whole epoch had trained.
    ("validation_shape", r"^validation_data: feed 'x:0' has shape \(20, 5\), but it takes shape "
                         r"\(None, 6\) \(None: any length\)$"),
    ("validation_lengths", r"^validation_data: arrays have different lengths along axis 0"),
    ("metric_shape", r"^fit: metric 'x' has shape \(None, 6\), not a scalar; give the mean over "
                     r"the batch$"),
    ("one_shot", r"^data is a one-shot iterator, which serves one epoch, but fit was asked for "
                 r"epochs=2; pass a list, or a callable that returns a new iterable for every "
                 r"epoch$"),
    # Accepted, and no checkpoint was ever written.
    ("checkpoint_every", r"^checkpoint_every=2 needs checkpoint_dir, the folder to write the "
                         r"checkpoints to$"),
])
def test_fit_refuses_what_would_fail_later_before_training(tf1, case, match):
    model, trainer, sess, feed = tf1
    x, y = model.inputs["x"], model.inputs["y"]
    kw = dict(batch_size=10, micro_batch_size=5, epochs=2, progress=False)
    data = feed
    if case == "validation_shape":
        kw["validation_data"] = {x: np.zeros((20, 5), np.float32), y: feed[y]}
    elif case == "validation_lengths":
        kw["validation_data"] = {x: feed[x][:7], y: feed[y]}
    elif case == "metric_shape":
        kw.update(validation_data=feed, metrics={"x": x})
    elif case == "one_shot":
        data = iter(hostavg.split(feed, 10))
    else:
        kw["checkpoint_every"] = 2
    before = sess.run(trainer.global_step)
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.fit(sess, data, **kw)
    assert sess.run(trainer.global_step) == before
