"""The notebooks run top to bottom, and what they show is right."""

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
NOTEBOOKS = ROOT / "notebooks"


def execute(name: str):
    """The notebook, executed top to bottom (a failing cell fails the test) with this checkout's
    hostavg (conftest.py puts it on the kernel's PYTHONPATH)."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user's
    # kernel starts: the notebook quiets TensorFlow itself
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute(env=env)
    return nb


def run(name: str) -> str:
    """Executes a notebook; returns everything it printed. Nothing goes to stderr."""
    return printed_by(execute(name), name)


def printed_by(nb, name: str) -> str:
    """Everything the executed notebook ``nb`` printed; asserts that nothing went to stderr."""
    stderr = [out["text"] for cell in nb.cells for out in cell.get("outputs", [])
              if out.get("name") == "stderr"]
    assert not stderr, f"{name} wrote to stderr: {stderr}"
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
    assert "self-check passed: 8 micro-batches give the whole batch's gradient" in printed
    assert float(re.search(r"test accuracy after \d+ steps: (\S+)", printed).group(1)) > 0.85


@pytest.mark.slow
def test_fit_progress_is_one_final_line_per_epoch_in_a_saved_notebook():
    nb = execute("quickstart")
    fit = next(c for c in nb.cells if "trainer.fit(" in c.source)
    lines = [out["data"]["text/plain"] for out in fit.outputs if out["output_type"] == "display_data"]
    assert len(lines) == 8, lines
    for epoch, line in enumerate(lines, 1):
        assert line.startswith(f"epoch {epoch}/8: 100%") and "\n" not in line and "\r" not in line
        assert "val_loss=" in line and "val_accuracy=" in line


@pytest.mark.slow
def test_inspect_gradients_finds_the_nan_by_micro_batch_sample_and_row_and_the_dead_layers():
    printed = run("inspect_gradients")
    assert "step, micro-batch 2 of 8 (samples 64:96): non-finite gradients in 'w1'" in printed
    assert "dropped: (2,)" in printed and "samples applied: 224 of 256" in printed
    assert "sample with a non-finite gradient: [5]" in printed
    assert re.search(r"fit, epoch 1/1, batch \d+/16, global step \d+: step, micro-batch \d of 8 "
                     r"\(samples \d+:\d+, data rows \[", printed), printed
    assert "culprit rows: [1234]" in printed and "row 1234 among e.rows: True" in printed
    assert "largest losses: samples [4, 19]" in printed


@pytest.mark.slow
def test_batch_size_checks_the_noise_scale_from_one_start_at_matched_samples():
    printed = run("batch_size")
    estimate = float(re.search(r"running B_simple after 150 steps: (\S+) samples", printed).group(1))
    assert 10 < estimate < 1e6
    one_step = {int(b): (float(f), float(p)) for b, f, p in re.findall(
        r"batch\s+(\d+): best step gets (\S+) of the full-batch step's improvement "
        r"\(predicted (\S+)\)", printed)}
    assert sorted(one_step) == [16, 64, 256, 1024, 2048]
    for b, (_, predicted) in one_step.items():
        assert predicted == pytest.approx(1 / (1 + estimate / b), abs=0.006)
    assert one_step[2048][0] > 0.5 > one_step[16][0]  # more samples per step help, then saturate
    runs = {int(b): (int(n), int(s), float(at16), float(end)) for b, n, s, at16, end in re.findall(
        r"batch\s+(\d+): (\d+) steps, (\d+) samples; loss after 16 steps (\S+), after \d+ "
        r"samples (\S+)", printed)}
    (small, (_, small_samples, small_16, small_end)), (near, (near_steps, near_samples, near_16,
                                                             near_end)) = sorted(runs.items())
    assert small < near and small_samples == near_samples and near_steps == 16
    assert near_16 < small_16  # per step, the batch near B is ahead
    assert small_end < near_end  # per sample, the small batch is


@pytest.mark.slow
def test_keras_notebook_matches_keras_finds_then_skips_the_nan_and_trains_and_draws():
    nb = execute("keras")
    printed = printed_by(nb, "keras")
    epochs, steps = map(int, re.search(r"trained (\d+) epochs, (\d+) steps", printed).groups())
    assert steps == 6 * epochs  # 1,500 digits in tf.data batches of 256
    accuracy, step = re.search(r"best checkpoint: digits test accuracy (\S+) \(optimizer step "
                               r"(\d+)\)", printed).groups()
    assert float(accuracy) > 0.8 and 0 < int(step) <= steps
    diff = float(re.search(r"max \|difference\| from Keras's own step = (\S+)", printed).group(1))
    assert diff < 1e-5, printed
    assert "output bias moved: False" in printed
    assert "step, micro-batch 2 of 8 (samples 64:96): non-finite gradients in 'mlp/hidden/kernel'" in printed
    assert "  sample 69 of the step: x holds NaN in column 300" in printed
    assert "dropped: (2,)" in printed and "samples applied: 224 of 256" in printed
    assert float(re.search(r"test accuracy after \d+ steps: (\S+)", printed).group(1)) > 0.85
    figures = [cell.source for cell in nb.cells for out in cell.get("outputs", [])
               if "image/png" in out.get("data", {})]
    assert len(figures) == 2, figures  # per step, micro-batch and variable; per micro-batch pair
    assert "hostavg.plot.micro_norms(history" in figures[0] and "cosine_heatmap(res" in figures[1]
