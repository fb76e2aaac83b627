"""WatchOutliers, on by default in every trainer, stays silent on healthy runs: 200 steps of
each of the tests' models (fresh data every step, micro-batches of unequal sizes)."""

import warnings

import pytest
from backends import BATCH, SIZES
from models import batches

import hostavg
from hostavg.hooks import WatchOutliers

STEPS = 200


@pytest.mark.parametrize("model", ["mlp", "embedding", "batchnorm", "sum"])
def test_a_healthy_run_of_each_model_warns_of_no_outlier(backend, model):
    face = backend.make(model, "adam")
    assert [type(h) for h in face.trainer.hooks] == [WatchOutliers]
    data = batches(0, STEPS, BATCH, sparse=model == "embedding")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [face.step(face.cut(d, SIZES)) for d in data]
    assert results[-1].step == STEPS
    assert not [str(w.message) for w in caught if issubclass(w.category, hostavg.OutlierWarning)]
    assert not any(m.outlier for r in results for m in r.micro)
