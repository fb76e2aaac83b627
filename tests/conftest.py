"""Every process the tests start (scripts, mpiexec ranks, notebook kernels) imports this
checkout's hostavg, not another one installed in editable mode. TensorFlow is imported here,
quietly (:func:`hostavg.import_tensorflow`): the lines it prints while it loads ignore a
TF_CPP_MIN_LOG_LEVEL set after the process started, so whichever test module imported it first
would put them in pytest's output."""

import os
from pathlib import Path

import pytest

import hostavg

ROOT = str(Path(__file__).parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT])
hostavg.import_tensorflow()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with ``--dist loadgroup``, every test that starts processes runs on one
    worker, one at a time: two MPI jobs or two killed-and-resumed fits at once on two cores would
    put more processes than cores behind the deadlines those tests assert. (CI runs them in a
    step of their own, without workers: .ci/run.)"""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("processes"))
