"""WatchOutliers and Diagnose, on by default in every trainer, stay silent on healthy runs: 200 steps of
each of the tests' models (fresh data every step, micro-batches of unequal sizes)."""

import warnings

import numpy as np

import pytest
from backends import BATCH, SIZES
from models import batches

import hostavg
from hostavg.core.results import Drop, Outlier, Search
from hostavg.engine import culprits
from hostavg.hooks import Diagnose, WatchOutliers

STEPS = 200


@pytest.mark.parametrize("model", ["mlp", "embedding", "batchnorm", "sum"])
def test_a_healthy_run_of_each_model_warns_of_no_outlier_and_reaches_no_verdict(backend, model):
    face = backend.make(model, "adam")
    assert [type(h) for h in face.trainer.hooks] == [WatchOutliers, Diagnose]
    data = batches(0, STEPS, BATCH, sparse=model == "embedding")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [face.step(face.cut(d, SIZES)) for d in data]
    assert results[-1].step == STEPS
    assert not [str(w.message) for w in caught if issubclass(w.category, hostavg.OutlierWarning)]
    assert not any(m.outlier for r in results for m in r.micro)
    assert not [str(w.message) for w in caught
                if issubclass(w.category, hostavg.DiagnosisWarning)]
    assert not any("diagnoses" in r.info for r in results)
    # Diagnose asked for the ratios of the first 20 applies, then one in 10
    assert [r.step for r in results if r.update_ratios is not None] == \
        list(range(1, 21)) + list(range(30, STEPS + 1, 10))


class DropsOne:
    """Asks for a search of micro-batch ``index`` and drops it once searched, as
    WatchOutliers(action="skip") does; counts the searches."""

    drops = False  # never at once: no snapshot before each compute but in the step computed again

    def __init__(self, index):
        self.index, self.searched = index, []

    def on_micro_batch(self, micro):
        if micro.index == self.index and micro.outlier is None:
            return Search(culprits.Contribution(10.0), Outlier("loss", micro.loss, 1.0, 1.0),
                          self.then)
        return None

    def then(self, micro):
        self.searched.append(micro.index)
        return Drop("dropped once searched")


def test_a_search_that_drops_computes_the_step_again_as_if_it_were_never_there(backend):
    """A micro-batch a search's ``then`` drops leaves the step (weights, Adam's moments, the
    moving statistics its forward pass assigned) as a step over the other micro-batches alone,
    searched once, its culprits kept."""
    hook = DropsOne(1)
    watched = backend.make("batchnorm", "adam", watch_outliers=False, hooks=[hook])
    plain = backend.make("batchnorm", "adam", watch_outliers=False)
    for d in batches(3, 2, BATCH):
        result = watched.step(watched.cut(d, SIZES))
        kept = plain.cut(d, SIZES)
        plain.step([kept[0], kept[2]])
    assert hook.searched == [1, 1]  # once a step
    assert [m.dropped for m in result.micro] == [None, "dropped once searched", None]
    assert result.micro[1].outlier is not None and result.size == BATCH - SIZES[1]
    expected, got = plain.values(), watched.values()
    assert expected.keys() == got.keys()
    for name in got:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
