"""The TF1 checked apply (hostavg.tf1.checked): what it keeps of each variable to undo with is
what the update can change, the rows of an embedding table where the optimizer writes only
those, and an update that goes non-finite is undone bit for bit."""

import numpy as np
import pytest
import tensorflow as tf
from models import CLASSES, VOCAB, build, graph_values, make_optimizer, v1
from test_tf1_wiring import AdamSubclass

import hostavg
from hostavg.tf1.checked import checked_train_op, rows_written
from hostavg.tf1.variables import assigned_variables, load_variables
from hostavg.tf1.walk import ops_run

#: The rows one micro-batch's ids touch (of VOCAB).
IDS = np.array([[3, 7, 7], [12, 3, 40], [49, 0, 21]], np.int32)


def _sparse_graph(optimizer):
    """The embedding model with ``optimizer``'s train op: (model, pairs, train_op, the tensors
    the apply is fed, every variable it writes)."""
    model = build(sparse=True)
    with model.graph.as_default():
        opt = make_optimizer(optimizer)
        pairs = [(g, v) for g, v in opt.compute_gradients(model.loss) if g is not None]
        step = v1.train.get_or_create_global_step()
        train_op = opt.apply_gradients(pairs, global_step=step)
        fed = tuple(t for g, _ in pairs for t in
                    ((g.indices, g.values) if isinstance(g, tf.IndexedSlices) else (g,)))
        variables = [v for _, v in pairs]
        written = variables + [v for v in assigned_variables(model.graph, [train_op], fed)
                               if v not in variables]
    return model, opt, pairs, train_op, fed, written, step


def _rows_moved(optimizer) -> dict:
    """The oracle: each written table's rows (variable or slot, by name) that a sparse apply of
    ``optimizer`` on IDS moved, after one that touched every row."""
    model, opt, pairs, train_op, fed, written, _ = _sparse_graph(optimizer)
    with model.graph.as_default():
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    every = np.arange(51, dtype=np.int32).reshape(17, 3) % VOCAB  # every row's slots non-zero
    sess.run(train_op, model.feed({"ids": every, "y": np.arange(17, dtype=np.int32) % CLASSES}))
    before = graph_values(model.graph, sess)
    sess.run(train_op, model.feed({"ids": IDS, "y": np.arange(3, dtype=np.int32) % CLASSES}))
    after = graph_values(model.graph, sess)
    return {v.op.name: set(np.flatnonzero(np.any(
        (after[v.op.name] != before[v.op.name]).reshape(len(before[v.op.name]), -1), axis=1)))
        for v in written if v.shape.rank == 2 and v.shape[0] == VOCAB}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "rmsprop", "adam-subclass"])
def test_rows_are_kept_exactly_where_the_optimizer_moves_only_the_fed_rows(optimizer):
    """Against the oracle of what an apply moved: a table and its slots are kept by rows where
    only fed rows moved, whole where others did too (Adam's own sparse update decays every
    row of its moments)."""
    make = (lambda: AdamSubclass(0.01)) if optimizer == "adam-subclass" else optimizer
    moved = _rows_moved(make)
    _, _, pairs, train_op, fed, written, _ = _sparse_graph(make)
    rows = dict(zip([v.op.name for v in written], rows_written(train_op, pairs, written, fed)))
    touched = set(np.unique(IDS))
    assert moved and all(rows[name] is not None for name in moved) == (optimizer != "adam-subclass")
    for name, got in moved.items():
        assert (got <= touched) == (rows[name] is not None), (name, sorted(got))
    assert all(rows[v.op.name] is None for v in written if v.op.name not in moved)


def test_the_checked_sparse_apply_reads_no_whole_table():
    """Under SGD the checked apply keeps the table's touched rows: no op of it reads the whole
    table (a read held across the update makes the optimizer copy the table first)."""
    model, opt, pairs, train_op, fed, written, step = _sparse_graph("sgd")
    with model.graph.as_default():
        checked = checked_train_op(lambda p: opt.apply_gradients(p, global_step=step), pairs,
                                   train_op, fed, whole=False)
    table, = [v for v in written if v.op.name == "embedding"]
    ops = list(ops_run([checked.op.op], fed))
    assert any(op.type == "ResourceGather" and op.inputs[0].op is table.op for op in ops)
    assert not [op.name for op in ops if op.type == "ReadVariableOp" and op.inputs[0].op is table.op]
    assert "embedding" in [v.op.name for v in checked.checked] and checked.before == []


def test_a_subclass_of_adam_whose_update_overflows_is_undone_whole():
    """Adam's own sparse update (a subclass of it keeps it) writes every row of its moments:
    the undo puts back all of them, bit for bit, when a touched row's second moment overflows."""
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, AdamSubclass(0.01))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    feed = model.feed({"ids": IDS, "y": np.arange(3, dtype=np.int32) % CLASSES})
    trainer.step(sess, [feed])
    grads = trainer.compute(sess, feed)
    before = model.values(sess)  # after the compute, which counts its forward pass
    g = grads["embedding"]
    huge = dict(grads, embedding=hostavg.SparseGradient(g.indices, np.full_like(g.values, 1e30),
                                                        g.dense_shape))
    with pytest.raises(hostavg.StepError, match="embedding/Adam_1"):
        trainer.apply(sess, huge)
    after = model.values(sess)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def test_a_finite_update_whose_sum_overflows_is_kept():
    """The check's quick sum of a finite table of float max entries overflows: the exact look
    finds every entry finite, and the update is kept, not undone."""
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.GradientDescentOptimizer(1e-3))
        table, = [v for v in v1.global_variables() if v.op.name == "embedding"]
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    feed = model.feed({"ids": IDS, "y": np.arange(3, dtype=np.int32) % CLASSES})
    grads = trainer.compute(sess, feed)  # of the weights as they were: finite
    big = np.full(table.shape, np.finfo(np.float32).max / 2, np.float32)
    load_variables(sess, [table], [big])
    assert trainer.apply(sess, grads) == 1
    after = sess.run(table)
    rows = np.unique(IDS)
    np.testing.assert_array_equal(np.delete(after, rows, axis=0), np.delete(big, rows, axis=0))
