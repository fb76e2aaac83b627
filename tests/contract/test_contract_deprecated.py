"""The call forms 0.1.0 took and 0.2.0 changed still work for one release, each with a
DeprecationWarning naming the new form, and give what the new form gives: ``check`` with the
micro-batch size third (TF1 ``check(sess, feed_dict, 32)``, Keras ``check(x, y, 32)``), an
integer of any kind; Keras ``compute((x, y))`` and ``per_sample((x, y))``, one tuple.

setup.cfg ignores DeprecationWarning for the suite; ``pytest.warns`` still sees it.
"""

import re

import numpy as np
import pytest
from backends import same
from models import batches

import hostavg


def _data():
    return batches(3, 1, 24)[0]


@pytest.mark.parametrize("size", [8, np.int64(8), np.int32(8), np.uint8(8)],
                         ids=["int", "int64", "int32", "uint8"])
def test_check_with_the_micro_batch_size_third_warns_and_checks_as_the_keyword(backend, size):
    face = backend.make()
    batch = face.args(face.native(_data()))
    old = "sess, feed_dict" if face.where else "x, y"
    said = (rf"^check\({old}, 8\) is deprecated since hostavg 0\.2\.0 and will be removed in "
            rf"0\.3\.0; write check\({old}, micro_batch_size=8\)$")
    with pytest.warns(DeprecationWarning, match=said) as warned:
        report = face.trainer.check(*face.where, *batch, size)
    assert warned[0].filename == __file__  # the warning points at the caller's line
    want = face.trainer.check(*face.where, *batch, micro_batch_size=8)
    assert (report.ok, report.micro_batches, report.max_rel_diff) == (
        want.ok, 3, want.max_rel_diff)


def test_keras_check_with_the_size_third_keeps_its_sample_weight_keyword(backend):
    face = backend.make()
    if face.where:
        pytest.skip("the TF1 face took blocks= then as now")
    x, y = face.args(face.native(_data()))
    weights = np.linspace(0.5, 1.5, len(y)).astype(np.float32)
    with pytest.warns(DeprecationWarning, match=r"^check\(x, y, 8\) is deprecated"):
        report = face.trainer.check(x, y, 8, sample_weight=weights)
    want = face.trainer.check(x, y, weights, micro_batch_size=8)
    assert report.max_rel_diff == want.max_rel_diff


def test_check_with_a_third_argument_that_is_no_integer_is_still_refused(backend):
    face = backend.make()
    batch = face.args(face.native(_data()))
    with pytest.raises((TypeError, hostavg.ArgumentError)):
        face.trainer.check(*face.where, *batch, 8.0, micro_batch_size=8)


@pytest.mark.parametrize("call", ["compute", "per_sample"])
def test_keras_compute_and_per_sample_of_one_tuple_warn_and_read_it_as_x_y(backend, call):
    face = backend.make()
    if face.where:
        pytest.skip("the TF1 face took a feed dict then as now")
    x, y = face.args(face.native(_data()))
    method = getattr(face.trainer, call)
    said = (rf"^{call}\(\(x, y\)\) is deprecated since hostavg 0\.2\.0 and will be removed in "
            rf"0\.3\.0; write {call}\(x, y\) \(or {call}\(\*batch\)\)$")
    with pytest.warns(DeprecationWarning, match=said) as warned:
        old = method((x, y))
    assert warned[0].filename == __file__
    new = method(x, y)
    if call == "compute":
        same(dict(old), dict(new))
    else:
        assert old.equals(new)
    weights = np.linspace(0.5, 1.5, len(y)).astype(np.float32)
    with pytest.warns(DeprecationWarning, match=rf"^{call}\(\(x, y, sample_weight\)\) is "):
        weighted = method((x, y, weights))
    if call == "compute":
        same(dict(weighted), dict(method(x, y, weights)))


def test_keras_check_of_one_tuple_and_compute_of_a_number_as_weights_are_refused(backend):
    face = backend.make()
    if face.where:
        pytest.skip("the Keras face's forms")
    x, y = face.args(face.native(_data()))
    with pytest.raises(hostavg.ArgumentError, match=r"^check takes x, y, sample_weight as "
                                                    r"train_on_batch does, and got one tuple of 2 "
                                                    r"as x; unpack the batch: check\(\*batch\)$"):
        face.trainer.check((x, y), micro_batch_size=8)
    for number in (4, np.int64(4)):
        with pytest.raises(hostavg.ArgumentError, match=rf"^compute takes x, y, sample_weight as "
                                                        rf"train_on_batch does, and got the number "
                                                        rf"{re.escape(repr(number))} as "
                                                        rf"sample_weight; pass an "
                                                        rf"array of one weight per sample$"):
            face.trainer.compute(x, y, number)
        with pytest.raises(hostavg.ArgumentError, match=r"got the number .* as sample_weight; "
                                                        r"pass micro_batch_size by keyword"):
            face.trainer.check(x, y, number, micro_batch_size=8)
