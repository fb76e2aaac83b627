"""Arguments that reached TensorFlow or NumPy raw, flags that were not booleans, and messages that
did not name the real problem. Each case is pinned by its message (issue 24, items 2 and 12, and
the unclear list)."""

import numpy as np
import pytest
import tensorflow as tf
from models import batches, build, keras_model, v1

import hostavg
from hostavg.hooks import ClipGlobalNorm, ClipMicroBatchNorm, Record
from hostavg.train.loop import ArraySource


def sgd():
    return v1.train.GradientDescentOptimizer(0.1)


@pytest.fixture(scope="module")
def tf1():
    """A dense model, its trainer, an initialised session and a batch of 20 samples."""
    model = build()
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, sgd())
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, trainer, sess, model.feed(batches(0, 1, 20)[0])


def kernel(model):
    return next(v for v in model.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
                if v.op.name == "hidden/kernel")


# --- var_list, accum_dtype, the variables -------------------------------------------------------


@pytest.mark.parametrize("given,match", [
    # Iterating a variable raised OperatorNotAllowedInGraphError.
    ("w", r"^var_list must be a list of variables, got the variable 'hidden/kernel'; e.g. "
          r"var_list=\[w\]$"),
    # NotImplementedError ('Trying to update a Tensor ', ...) from the optimizer.
    ("[loss]", r"^var_list holds the tensor 'Mean:0', not a variable; list the variables to "
               r"train$"),
    # "variable None of another graph".
    ("[None]", r"^var_list holds None, not a variable; list the variables to train$"),
    # Accepted, then the apply's feed was blamed ("fed more than once").
    ("[w, w]", r"^var_list holds 'hidden/kernel' twice; list each variable once$"),
    ("[other]", r"^var_list holds variable 'v:0' of another graph than the loss's; pass variables of "
                r"the graph the loss was built in$"),
])
def test_a_var_list_that_is_no_list_of_the_graphs_variables_is_refused(given, match):
    model = build()
    w = kernel(model)
    with tf.Graph().as_default():
        other = tf.Variable(1.0, name="v")
    var_list = {"w": w, "[loss]": [model.loss], "[None]": [None], "[w, w]": [w, w],
                "[other]": [other]}[given]
    with model.graph.as_default(), pytest.raises(hostavg.HostavgError, match=match):
        hostavg.Trainer(model.loss, sgd(), var_list=var_list)


def test_a_complex_variable_is_refused_naming_it():
    # TensorFlow's "Invalid type tf.complex64 for Variable:0" came out as a raw ValueError.
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.complex64, [None, 2])
        w = tf.Variable(np.ones(2, np.complex64), name="c")
        loss = tf.math.real(tf.reduce_mean(tf.reduce_sum(x * w, 1)))
        with pytest.raises(hostavg.HostavgError, match=r"^the optimizer cannot train the variables "
                           r"the loss reaches \(Invalid type tf.complex64 for c:0, expected: .*\); "
                           r"hostavg trains real floating-point variables: leave the others out "
                           r"with var_list$"):
            hostavg.Trainer(loss, sgd())


def test_accum_dtype_takes_a_tensorflow_dtype():
    # accum_dtype=tf.float64 was refused ("must be a floating-point dtype ..., got tf.float64").
    model = build()
    with model.graph.as_default():
        assert hostavg.Trainer(model.loss, sgd(), accum_dtype=tf.float64).accum_dtype == np.float64
    assert hostavg.Accumulator({"w": hostavg.VariableSpec((1,), np.float32, False)},
                               accum_dtype=tf.float64).accum_dtype == np.float64


def test_an_accum_dtype_tensorflow_has_not_is_refused_with_average_graph():
    # TypeError: Cannot convert the argument `type_value`: dtype('float128') to a TensorFlow DType.
    model = build()
    with model.graph.as_default(), pytest.raises(
            hostavg.HostavgError, match=r"^accum_dtype float128 has no TensorFlow dtype, and "
                                        r"average='graph' sums in the session: pass float16, "
                                        r"float32 or float64, or average='host'$"):
        hostavg.Trainer(model.loss, sgd(), accum_dtype="longdouble", average="graph")


# --- Feeds, split, evaluate's metrics, step_together --------------------------------------------


def test_an_eager_tensor_as_a_feed_value_is_refused_naming_the_feed(tf1):
    # AttributeError: Tensor.name is undefined when eager execution is enabled.
    model, trainer, sess, feed = tf1
    x = model.inputs["x"]
    with pytest.raises(hostavg.HostavgError, match=r"^step, micro-batch 0 of 1: feed 'x:0' is an "
                                                   r"eager tensor; feed its value, such as "
                                                   r"tensor.numpy\(\)$"):
        trainer.step(sess, [{**feed, x: tf.constant(feed[x])}])


@pytest.mark.parametrize("batch", ["dict", "tuple"])
def test_split_refuses_ragged_lists_naming_them(batch):
    # ValueError: setting an array element with a sequence (NumPy's own).
    ragged = [[1.0, 2.0], [3.0]]
    data = {"x": ragged} if batch == "dict" else (ragged, [0, 1])
    name = "'x'" if batch == "dict" else r"batch\[0\]"
    with pytest.raises(hostavg.HostavgError, match=rf"^split: {name} cannot be made an array "
                                                   rf"\(setting an array element"):
        hostavg.split(data, 1)


def test_evaluate_refuses_a_metric_of_another_graph_or_not_a_scalar(tf1):
    # A metric of another graph was blamed on "that micro-batch's feed".
    model, trainer, sess, feed = tf1
    with tf.Graph().as_default():
        other = tf.constant(1.0)
    with pytest.raises(hostavg.HostavgError, match=r"^evaluate: metric 'a' is 'Const:0', a tensor "
                                                   r"of another graph than the loss's; give a "
                                                   r"scalar tensor of the loss's graph$"):
        trainer.evaluate(sess, feed, batch_size=10, metrics={"a": other})
    with pytest.raises(hostavg.HostavgError, match=r"^evaluate: metric 'a' has shape \(None, 6\), "
                                                   r"not a scalar; give the mean over the batch$"):
        trainer.evaluate(sess, feed, batch_size=10, metrics={"a": model.inputs["x"]})
    with pytest.raises(hostavg.HostavgError, match=r"^evaluate: metric 'a' is 1.0, not a tensor of "
                                                   r"the loss's graph"):
        trainer.evaluate(sess, feed, batch_size=10, metrics={"a": 1.0})


def test_step_together_echoes_what_it_got(tf1):
    _, _, sess, _ = tf1
    with pytest.raises(hostavg.HostavgError, match=r"^step_together takes a non-empty list of "
                                                   r"\(trainer, batches\) pairs, got None$"):
        hostavg.step_together(sess, None)


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


def test_record_tables_refuse_a_micro_that_is_no_bool(tmp_path, tf1):
    model, _, _, feed = tf1
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, sgd(), hooks=[Record(tmp_path / "rec")])
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        trainer.step(sess, hostavg.split(feed, 10))
    record = hostavg.load_record(tmp_path / "rec")
    with pytest.raises(hostavg.HostavgError, match=r"^micro must be True or False, got 'False'$"):
        record.variable_norms(micro="False")


# --- Hooks and callbacks take NumPy's numbers ---------------------------------------------------


@pytest.mark.parametrize("hook", [ClipGlobalNorm, ClipMicroBatchNorm])
@pytest.mark.parametrize("value", [np.float32(1.0), np.int64(2), np.float16(0.5)],
                         ids=["float32", "int64", "float16"])
def test_clip_hooks_take_numpy_numbers(hook, value):
    # np.float32(1.0) and np.int64(2) were refused as "not a finite number > 0".
    assert hook(value).max_norm == float(value)


@pytest.mark.parametrize("hook", [ClipGlobalNorm, ClipMicroBatchNorm])
@pytest.mark.parametrize("value", [0, -1.0, np.nan, "1", True, 1 + 0j])
def test_clip_hooks_refuse_what_is_no_finite_positive_number(hook, value):
    with pytest.raises(hostavg.HostavgError, match=r"^max_norm must be a finite number > 0, got "):
        hook(value)


def test_early_stopping_takes_numpy_integers_and_refuses_text():
    assert hostavg.EarlyStopping(patience=np.int64(2), min_delta=np.float32(0.5)).patience == 2
    with pytest.raises(hostavg.HostavgError, match=r"^min_delta must be a finite number >= 0, got "
                                                   r"'abc'$"):
        hostavg.EarlyStopping(min_delta="abc")


# --- Plots --------------------------------------------------------------------------------------


def test_plots_refuse_an_ax_that_is_no_axes(tf1):
    # plot.micro_norms(results, ax="ax") raised AttributeError: 'str' object has no attribute ...
    model, trainer, sess, feed = tf1
    pytest.importorskip("matplotlib")
    results = [trainer.step(sess, hostavg.split(feed, 10))]
    with pytest.raises(hostavg.HostavgError, match=r"^hostavg.plot.micro_norms: ax must be "
                                                   r"matplotlib Axes \(or None for a new figure\), "
                                                   r"got 'ax'$"):
        hostavg.plot.micro_norms(results, ax="ax")


def test_variable_norms_of_update_ratios_never_measured_says_how_to_measure_them(tf1, tmp_path):
    model, _, _, feed = tf1
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, sgd(), hooks=[Record(tmp_path / "rec")])
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        trainer.step(sess, hostavg.split(feed, 10))
    pytest.importorskip("matplotlib")
    with pytest.raises(hostavg.HostavgError, match=r"^hostavg.plot.variable_norms: no step holds "
                                                   r"update_ratio values: update ratios are "
                                                   r"measured only when the trainer is made with "
                                                   r"update_ratios_every=N"):
        hostavg.plot.variable_norms(hostavg.load_record(tmp_path / "rec"), quantity="update_ratio")


# --- The Keras face's batches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def keras_trainer():
    import keras
    import hostavg.keras
    return hostavg.keras.Trainer(keras_model(), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.SGD(0.1))


def test_keras_refuses_ragged_lists_naming_them(keras_trainer):
    # ValueError: setting an array element with a sequence (NumPy's own).
    with pytest.raises(hostavg.HostavgError, match=r"^compute: x cannot be made an array "
                                                   r"\(setting an array element"):
        keras_trainer.compute([[1.0] * 6, [1.0] * 5], np.zeros(2, np.int32))


def test_keras_refuses_complex_inputs_as_the_tf1_face_does(keras_trainer):
    # Cast to float32 silently, imaginary part dropped.
    x = np.ones((4, 6), np.complex64) * 1j
    with pytest.raises(hostavg.HostavgError, match=r"^compute: x holds complex values \(complex64\), "
                                                   r"whose imaginary part the model would drop; "
                                                   r"pass real arrays$"):
        keras_trainer.compute(x, np.zeros(4, np.int32))


def test_keras_multi_output_model_with_one_target_array_says_so():
    # "Structures don't have the same nested structure" / "Expected any non-tensor type".
    # Compiled with one loss, a two-output model needs a target per output, as in Keras.
    import keras
    import hostavg.keras
    x = keras.Input((6,))
    model = keras.Model(x, [keras.layers.Dense(3)(x), keras.layers.Dense(3)(x)])
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.SGD(0.1))
    with pytest.raises(hostavg.HostavgError, match=r"^compute: the model cannot run on this batch "
                                                   r"\(KeyError: .*in the `loss` argument.*\); "
                                                   r"check its x and y against the model's inputs "
                                                   r"and the loss$"):
        trainer.compute(np.ones((4, 6), np.float32), np.zeros(4, np.int32))


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


def test_keras_input_of_the_wrong_width_names_the_layer_not_keras_arguments():
    # "(ValueError: • kwargs=<class 'inspect._empty'>)": the last line of Keras's arguments.
    import keras
    import hostavg.keras
    model = keras.Sequential([keras.layers.Dense(8, name="first"), keras.layers.Dense(3)])
    trainer = hostavg.keras.Trainer(model, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), keras.optimizers.SGD(0.1))
    y = np.zeros(8, np.int32)
    trainer.compute(np.ones((8, 6), np.float32), y)
    with pytest.raises(hostavg.HostavgError, match=r"^compute: the model cannot run on this batch "
                       r"\(ValueError: Input 0 with name 'None' of layer 'first' is incompatible "
                       r"with the layer: expected axis -1 of input shape to have value 6, but "
                       r"received input with shape \(None, 4\)\); check its x and y"):
        trainer.compute(np.ones((8, 4), np.float32), y)
