"""``hostavg bench --programs`` times equal work: Trainer.fit and Keras's own accumulation in
model.fit train the same program to the same weights (on whichever Keras backend runs)."""

import json

import numpy as np
import pytest

from hostavg.cli import bench_programs, main


@pytest.mark.parametrize("name", list(bench_programs.PROGRAMS))
def test_both_fits_of_a_program_end_with_the_same_weights(name):
    # Without dropout the two are the same training: 2 batches of k = 4 micro-batches each.
    fits, (keras_model, hostavg_model) = bench_programs.twins(
        name, k=4, samples=2 * bench_programs.BATCH_SIZES[name], dropout=0.0)
    before = [w.copy() for w in keras_model.get_weights()]
    for fit in fits.values():
        fit()
    # Two applies each (Keras counts its accumulated micro-batches apart).
    assert int(keras_model.optimizer.iterations) == 2
    assert int(hostavg_model.optimizer.iterations) == 2
    moved = 0.0
    for b, k, h in zip(before, keras_model.get_weights(), hostavg_model.get_weights()):
        np.testing.assert_allclose(h, k, rtol=2e-4, atol=2e-6)
        moved = max(moved, float(np.abs(k - b).max()))
    assert moved > 1e-4  # both trained: the comparison is not of two untouched models


def test_bench_programs_prints_a_row_per_program_and_writes_json(tmp_path, capsys):
    out = tmp_path / "programs.json"
    assert main(["bench", "--programs", "structured", "--k", "2", "--repeats", "2",
                 "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["program", "(Keras", "on"]
    assert lines[1].split()[:2] == ["structured", "k=2"]
    assert lines[2].startswith("(median seconds of one epoch of 8 steps, 2 epochs each")
    (row,) = json.loads(out.read_text())["programs"]
    assert row["program"] == "structured" and row["k"] == 2
    t = row["median_s"]
    assert row["ratio"] == pytest.approx(t["hostavg-fit"] / t["keras-fit"])


def test_bench_programs_names_an_unknown_program(capsys):
    assert main(["bench", "--programs", "resnet"]) != 0
    err = capsys.readouterr().err
    assert "unknown program resnet; the programs are convnet, bilstm, structured, " \
           "transformer" in err


def test_bench_programs_refuses_a_k_that_does_not_divide_a_batch(capsys):
    assert main(["bench", "--programs", "convnet,structured", "--k", "3"]) != 0
    err = capsys.readouterr().err
    assert "--k 3 does not divide the batch size of convnet (128), structured (32)" in err
