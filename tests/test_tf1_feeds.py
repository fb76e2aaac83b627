"""The TF1 face's feeds (hostavg.tf1.feeds): every micro-batch's feed dict checked as sess.run
checks it, stricter where NumPy would change a value, and the train op's other inputs (a
learning-rate placeholder) fed to the apply."""

import numpy as np
import pytest
import tensorflow as tf
from models import linear, rows, tf1
from test_trainer import Case, unchanged

import hostavg


# --- Feeds are checked like sess.run checks them, and stricter where NumPy changes values -----


@pytest.mark.parametrize("bad,match", [
    # The compiled call skips sess.run's shape check: (8, 1) broadcast against [None, 6].
    ("x", r"^step, micro-batch 1 of 4: feed 'x:0' has shape \(8, 1\), but it takes shape "
          r"\(None, 6\)"),
    # A Python int above int32's range raised a raw OverflowError.
    ("y_python", r"^step, micro-batch 1 of 4: feed 'y:0' holds values outside int32's range "
                 r"\[-2147483648, 2147483647\] \(min 1099511627776"),
    # A NumPy int64 above it wrapped around silently.
    ("y_int64", r"feed 'y:0' holds values outside int32's range .*max 1099511627776\)"),
    # Float labels were truncated silently.
    ("y_float", r"feed 'y:0' holds values that are not integers \(such as 1.5\) for a int32 "
                r"placeholder"),
    ("x_none", r"feed 'x:0' holds None of dtype object, but the placeholder takes float32"),
    ("x_text", r"feed 'x:0' holds 'a' of dtype <U1, but the placeholder takes float32"),
    ("x_tensor", r"feed 'x:0' is the graph element 'Const(_\d)?:0'; feed values, such as NumPy "
                 r"arrays, not tensors"),
    ("x_ragged", r"feed 'x:0' cannot be made an array"),
])
def test_a_bad_feed_is_refused_before_anything_runs_naming_key_and_micro_batch(bad, match):
    case = Case(update_op=True)
    x, y = case.model.inputs["x"], case.model.inputs["y"]
    with case.model.graph.as_default():
        tensor = tf.constant(1.0)
    feeds = [dict(f) for f in case.feeds]
    feeds[1] = {**feeds[1], **{
        "x": {x: np.ones((8, 1), np.float32)},
        "y_python": {y: [2 ** 40] * 10},
        "y_int64": {y: np.full(10, 2 ** 40)},
        "y_float": {y: np.full(10, 1.5)},
        "x_none": {x: None},
        "x_text": {x: "a"},
        "x_tensor": {x: tensor},
        "x_ragged": {x: [[1.0, 2.0], [3.0]]},
    }[bad]}
    unchanged(case, lambda: case.trainer.step(case.sess, feeds), match)
    assert case.sess.run(case.model.counter) == 0  # refused before any micro-batch ran


def test_feeds_that_convert_without_changing_a_value_are_taken():
    a, b = Case(), Case()
    x, y = a.model.inputs["x"], a.model.inputs["y"]
    feeds = [{x: f[x].astype(np.float64), y: f[y].astype(np.float64)} for f in a.feeds]
    got = a.trainer.step(a.sess, feeds)  # float64 inputs, whole-number float labels
    want = b.trainer.step(b.sess, b.feeds)
    for name in want.grads:
        np.testing.assert_allclose(got.grads[name], want.grads[name], rtol=1e-6, err_msg=name)


def test_a_placeholder_missing_from_a_later_micro_batch_is_refused_before_any_runs():
    # Micro-batch 0 ran (its UPDATE_OPS moved the moving mean, its hook was called) before the
    # session refused micro-batch 1 for the label it lacked.
    seen = []

    class Seen:
        def on_micro_batch(self, micro):
            seen.append(micro.index)

    case = Case(update_op=True, hooks=[Seen()])
    y = case.model.inputs["y"]
    feeds = [dict(f) for f in case.feeds]
    del feeds[1][y]
    unchanged(case, lambda: case.trainer.step(case.sess, feeds),
              r"^step, micro-batch 1 of 4: the graph reads placeholder 'y:0', which this feed "
              r"does not give; feed it to every micro-batch")
    assert case.sess.run(case.model.counter) == 0 and seen == []  # refused before any ran


# --- The train op's other inputs (a learning-rate placeholder) reach the apply ----------------


def test_a_learning_rate_placeholder_is_fed_to_the_apply_from_the_micro_batches():
    trainer, sess, x, w, lr = linear(lr_placeholder="required")
    assert trainer.apply_inputs == {"lr:0": lr}
    feeds = [{x: np.full((2, 4), 1.0, np.float32), lr: 0.5},
             {x: np.full((2, 4), 3.0, np.float32), lr: 0.5}]
    res = trainer.step(sess, feeds)
    np.testing.assert_array_equal(sess.run(w), np.full(4, -0.5 * 2.0, np.float32))
    trainer.step(sess, hostavg.split({x: np.ones((4, 4), np.float32), lr: 0.0}, 2))  # a schedule
    np.testing.assert_array_equal(sess.run(w), np.full(4, -1.0, np.float32))
    assert res.step == 1 and sess.run(trainer.global_step) == 2
    # apply takes it in feed_dict (by name too), and refuses to run without it.
    assert trainer.apply(sess, {"w": np.ones(4)}, feed_dict={"lr": 0.25}) == 3
    np.testing.assert_array_equal(sess.run(w), np.full(4, -1.25, np.float32))
    with pytest.raises(hostavg.HostavgError, match=r"^apply: the train op reads 'lr:0', which "
                       r"feed_dict 0 does not feed; pass it: trainer.apply\(sess, grads, "
                       r"feed_dict=\{placeholder: value\}\)"):
        trainer.apply(sess, {"w": np.ones(4)})
    assert sess.run(trainer.global_step) == 3


@pytest.mark.parametrize("feeds,match", [
    (lambda x, lr: [{x: np.ones((2, 4), np.float32), lr: 0.5},
                    {x: np.ones((2, 4), np.float32), lr: 0.1}],
     r"^step: micro-batches 0 and 1 feed different values to 'lr:0' \(0.5 and 0.1(0000\d+)?\), "
     r"which the train op reads; the train op runs once per step"),
    (lambda x, lr: [{x: np.ones((2, 4), np.float32)}],
     r"^step: the train op reads 'lr:0', which micro-batch 0 does not feed; feed it, the same "
     r"value, to every micro-batch"),
])
def test_a_learning_rate_that_differs_or_is_missing_is_refused_before_anything_runs(feeds, match):
    trainer, sess, x, w, lr = linear(lr_placeholder="required")
    with pytest.raises(hostavg.HostavgError, match=match):
        trainer.step(sess, feeds(x, lr))
    assert sess.run(trainer.global_step) == 0


def test_a_learning_rate_with_a_default_may_go_unfed():
    trainer, sess, x, w, lr = linear(lr=0.25, lr_placeholder="default")
    trainer.step(sess, [rows(x, 1.0)])
    np.testing.assert_array_equal(sess.run(w), np.full(4, -0.25, np.float32))
    trainer.step(sess, [{**rows(x, 1.0), lr: 1.0}])
    np.testing.assert_array_equal(sess.run(w), np.full(4, -1.25, np.float32))


# --- An eager tensor as a feed value ----------------------------------------------------------


def test_an_eager_tensor_as_a_feed_value_is_refused_naming_the_feed(tf1):
    # AttributeError: Tensor.name is undefined when eager execution is enabled.
    model, trainer, sess, feed = tf1
    x = model.inputs["x"]
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 0 of 1: feed 'x:0' is an "
                                                   r"eager tensor; feed its value, such as "
                                                   r"tensor.numpy\(\)$"):
        trainer.step(sess, [{**feed, x: tf.constant(feed[x])}])
