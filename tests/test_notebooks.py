"""The notebooks run top to bottom, and what they show is right."""

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
NOTEBOOKS = ROOT / "notebooks"


def run(name: str) -> str:
    """Executes a notebook (a failing cell fails the test); returns everything it printed.

    The kernel imports the checkout's hostavg (its root first on PYTHONPATH), not another
    installed copy.
    """
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved) if p)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    printed = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("name") == "stdout":
                printed.append(out["text"])
    return "".join(printed)


def test_notebooks_are_stored_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name


@pytest.mark.slow
def test_quickstart_shows_the_accumulated_step_equals_the_full_batch_step():
    printed = run("quickstart")
    diffs = [float(d) for d in re.findall(r"max \|difference\| = (\S+)", printed)]
    assert len(diffs) == 2 and max(diffs) < 1e-5, printed
    assert "self-check passed: 8 micro-batches give the whole feed's gradient" in printed
    assert float(re.search(r"test accuracy after \d+ steps: (\S+)", printed).group(1)) > 0.85


@pytest.mark.slow
def test_inspect_gradients_finds_then_skips_the_corrupted_micro_batch():
    printed = run("inspect_gradients")
    assert "step, micro-batch 2 of 8 (samples 64:96): non-finite gradients in 'w1'" in printed
    assert "dropped: (2,)" in printed and "samples applied: 224 of 256" in printed


@pytest.mark.slow
def test_batch_size_estimates_the_noise_scale_and_compares_two_batches():
    printed = run("batch_size")
    estimate = float(re.search(r"running B_simple after 150 steps: (\S+) samples", printed).group(1))
    assert 10 < estimate < 1e6
    steps = {int(b): int(s) for b, s in re.findall(r"batch\s+(\d+): (\d+) steps", printed)}
    assert steps[16] == 2500 and len(steps) == 2


@pytest.mark.slow
def test_keras_notebook_matches_keras_finds_then_skips_the_nan_and_trains():
    printed = run("keras")
    diff = float(re.search(r"max \|difference\| from Keras's own step = (\S+)", printed).group(1))
    assert diff < 1e-5, printed
    assert "output bias moved: False" in printed
    assert "step, micro-batch 2 of 8 (samples 64:96): non-finite gradients in 'mlp/hidden/kernel'" in printed
    assert "dropped: (2,)" in printed and "samples applied: 224 of 256" in printed
    assert float(re.search(r"test accuracy after \d+ steps: (\S+)", printed).group(1)) > 0.85
