"""The two faces are one API: every public method is declared once, by BaseTrainer, with one
docstring; a face differs from it only where :data:`DIFFERENCES` says, and says why in its own
docstring. An undeclared difference (a renamed argument, another default, a new keyword, a
docstring of its own) fails here."""

import inspect

import hostavg
import hostavg.keras
import pytest
from hostavg.train.trainer import BaseTrainer

#: The public methods, declared by BaseTrainer.
METHODS = sorted(name for name, value in vars(BaseTrainer).items()
                 if not name.startswith("_") and callable(value))

#: Per face and method: (what it takes first, what stands for the base's data argument,
#: the keywords only it takes). The data argument is the base's first one where it has one.
DIFFERENCES = {
    hostavg.Trainer: {
        "accumulator": (["sess"], None, []),
        "compute": (["sess"], ["feed_dict"], []),
        "apply": (["sess"], None, ["feed_dict"]),
        "step": (["sess"], ["feeds"], ["fetches"]),
        "check": (["sess"], ["feed_dict"], ["blocks"]),
        "per_sample": (["sess"], ["feed_dict"], []),
        "hvp": (["sess"], ["feed_dict"], []),
        "curvature": (["sess"], ["feed_dict"], []),
        "evaluate": (["sess"], ["data"], ["metrics"]),
        "fit": (["sess"], ["data"], ["metrics", "inputs", "blocks", "fetches"]),
        "save": (["sess"], None, []),
        "restore": (["sess"], None, []),
    },
    hostavg.keras.Trainer: {
        "accumulator": ([], None, []),
        "compute": ([], ["x", "y", "sample_weight"], []),
        "apply": ([], None, []),
        "step": ([], ["batches"], []),
        "check": ([], ["x", "y", "sample_weight"], []),
        "per_sample": ([], ["x", "y", "sample_weight"], []),
        "hvp": ([], ["x", "y", "sample_weight"], []),
        "curvature": ([], ["x", "y", "sample_weight"], []),
        "evaluate": ([], ["x", "y"], ["sample_weight"]),
        "fit": ([], ["x", "y"], ["validation_split", "class_weight", "sample_weight",
                                 "validation_batch_size", "validation_steps"]),
        "save": ([], None, []),
        "restore": ([], None, []),
    },
}
#: The data argument of each base method that has one.
DATA = {"compute": "batch", "step": "batches", "check": "batch", "per_sample": "batch",
        "hvp": "batch", "curvature": "batch",
        "evaluate": "data", "fit": "data"}


def parameters(function) -> list:
    return list(inspect.signature(function).parameters.values())[1:]  # self


@pytest.mark.parametrize("face", DIFFERENCES, ids=["tf1", "keras"])
@pytest.mark.parametrize("method", METHODS)
def test_each_face_takes_the_declared_arguments_with_the_declared_defaults(face, method):
    first, data, only = DIFFERENCES[face][method]
    base = parameters(getattr(BaseTrainer, method))
    if method in DATA:
        assert base[0].name == DATA[method]
        base = base[1:]
    got = parameters(getattr(face, method))
    names = [p.name for p in got]
    want = first + (data or []) + [p.name for p in base]
    assert names[:len(want)] == want and names[len(want):] == only, (
        f"{face.__module__}.{method} takes {names}; declared: {want} + face-only {only}")
    shared = got[len(first) + len(data or []):len(want)]
    for mine, declared in zip(shared, base):
        assert (mine.default, mine.kind) == (declared.default, declared.kind), (
            f"{method}({mine.name}) is {mine} on {face.__module__}, declared {declared}")
    assert all(p.kind is p.KEYWORD_ONLY or p.default is not p.empty for p in got[len(want):])


@pytest.mark.parametrize("face", DIFFERENCES, ids=["tf1", "keras"])
@pytest.mark.parametrize("method", METHODS)
def test_each_method_has_the_one_docstring_of_its_declaration(face, method):
    assert method in vars(face), f"{face.__module__} does not implement {method}"
    assert vars(face)[method].__doc__ is None, f"{face.__module__}.{method} has its own docstring"
    assert inspect.getdoc(getattr(face, method)) == inspect.getdoc(getattr(BaseTrainer, method))


@pytest.mark.parametrize("face", DIFFERENCES, ids=["tf1", "keras"])
def test_what_a_face_alone_takes_is_said_in_its_docstring(face):
    said = face.__doc__
    for first, _, only in DIFFERENCES[face].values():
        for name in first + only:
            assert f"{name}" in said, f"{face.__module__}.Trainer's docstring never names {name}"


@pytest.mark.parametrize("face", DIFFERENCES, ids=["tf1", "keras"])
def test_the_constructor_keywords_every_face_shares_have_the_same_defaults(face):
    declared = {p.name: p for p in parameters(BaseTrainer.__init__)}
    mine = {p.name: p for p in parameters(face.__init__)}
    for name, p in declared.items():
        assert name in mine and (mine[name].default, mine[name].kind) == (p.default, p.kind), name


def test_both_faces_have_the_same_public_attributes():
    from models import build, keras_model
    v1 = hostavg.import_tensorflow().compat.v1
    built = build()
    with built.graph.as_default():
        tf1 = hostavg.Trainer(built.loss, v1.train.GradientDescentOptimizer(0.1),
                              micro_batch_size=4)
    keras_face = hostavg.keras.Trainer(keras_model(), "sparse_categorical_crossentropy", "sgd",
                                       micro_batch_size=4)
    shared = ("micro_batch_size", "micro_batches", "accumulate", "accum_dtype", "hooks", "comm",
              "update_ratios_every", "overlap", "distributions_every", "check_applied", "loss",
              "rollback_variables")
    for trainer in (tf1, keras_face):
        for name in shared:
            getattr(trainer, name)
        assert (trainer.micro_batch_size, trainer.micro_batches) == (4, None)


def test_the_keras_face_takes_0_1_0_s_forms_with_a_warning_and_refuses_others_like_them():
    """Keras's train_on_batch form: a tuple (x, y) given as x (0.1.0's compute((x, y))) or the
    micro-batch size where sample_weight stands (0.1.0's check(x, y, 32)) work for one release
    with a DeprecationWarning (tests/contract/test_contract_deprecated.py); a tuple given to
    check, or a number as compute's sample_weight, was never a form: refused naming what to
    write."""
    import numpy as np
    from models import CLASSES, FEATURES, keras_model
    trainer = hostavg.keras.Trainer(keras_model(), "sparse_categorical_crossentropy", "sgd")
    x = np.ones((8, FEATURES), np.float32)
    y = np.arange(8) % CLASSES
    with pytest.warns(DeprecationWarning, match=r"^compute\(\(x, y\)\) is deprecated"):
        assert trainer.compute((x, y)).size == 8
    with pytest.warns(DeprecationWarning, match=r"^check\(x, y, 4\) is deprecated"):
        assert trainer.check(x, y, 4).micro_batches == 2
    with pytest.raises(hostavg.ArgumentError, match=r"^check takes x, y, sample_weight as "
                                                    r"train_on_batch does, and got one tuple of 2 "
                                                    r"as x; unpack the batch: check\(\*batch\)$"):
        trainer.check((x, y), micro_batch_size=4)
    with pytest.raises(hostavg.ArgumentError, match=r"got the number 4 as sample_weight; pass an "
                                                    r"array of one weight per sample$"):
        trainer.compute(x, y, 4)
    assert trainer.compute(x, y).size == 8
