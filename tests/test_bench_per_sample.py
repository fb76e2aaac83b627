"""``hostavg bench --per-sample`` times per_sample against a compute on each face, and its
memory probe shows what the chunk size bounds."""

import json

import pytest

from hostavg.cli import bench, bench_per_sample
from hostavg.cli import main
from hostavg.engine.samples import DEFAULT_CHUNK_BYTES

#: Parameters of logreg: a 784 x 10 kernel and 10 biases.
LOGREG_PARAMETERS = 784 * 10 + 10


def test_bench_per_sample_prints_a_row_per_face_with_its_ratio_and_writes_json(tmp_path, capsys):
    path = tmp_path / "per_sample.json"
    assert main(["bench", "--per-sample", "--models", "logreg", "--micro-batch-sizes", "8",
                 "--repeats", "3", "--no-memory", "--json", str(path)]) == 0
    faces = bench.faces(bench.keras_backend())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["configuration", "face", "params", "chunk", "compute",
                                "per_sample", "ratio"]
    rows = [line.split() for line in lines[1:1 + len(faces)]]
    assert [row[:4] for row in rows] == [["logreg,", "8", "samples", face] for face in faces]
    result = json.loads(path.read_text())
    assert set(result) == {"format", "machine", "keras_backend", "repeats", "timing"}  # no memory
    assert (result["format"], result["repeats"]) == (bench_per_sample.FORMAT, 3)
    for row, timed, face in zip(rows, result["timing"], faces):
        assert set(timed) == {"model", "samples", "face", "chunk_size", "parameters",
                              "compute_s", "per_sample_s", "ratio"}
        assert (timed["model"], timed["samples"], timed["face"], timed["chunk_size"],
                timed["parameters"]) == ("logreg", 8, face, DEFAULT_CHUNK_BYTES // (
                    4 * LOGREG_PARAMETERS), LOGREG_PARAMETERS)
        assert timed["per_sample_s"] > 0 and timed["compute_s"] > 0  # one call each, or more
        assert timed["ratio"] == timed["per_sample_s"] / timed["compute_s"]
        assert row[4:] == [f"{LOGREG_PARAMETERS:,}", f"{timed['chunk_size']:,}",
                           f"{timed['compute_s'] * 1e3:.2f}ms",
                           f"{timed['per_sample_s'] * 1e3:.1f}ms", f"{timed['ratio']:.1f}x"]
    assert "chunk_size its default (64 MiB of gradients)" in lines[1 + len(faces)]


def test_bench_per_sample_times_the_chunk_size_it_is_given(tmp_path, capsys):
    path = tmp_path / "per_sample.json"
    assert main(["bench", "--per-sample", "--models", "logreg", "--micro-batch-sizes", "8",
                 "--repeats", "1", "--no-memory", "--chunk-size", "3", "--json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {row["chunk_size"] for row in json.loads(path.read_text())["timing"]} == {3}
    assert lines[1].split()[5] == "3" and "chunk_size 3;" in lines[-1]


def test_bench_chunk_size_is_per_samples_alone(capsys):
    assert main(["bench", "--models", "logreg", "--chunk-size", "3"]) == 2
    assert capsys.readouterr().err == ("hostavg bench: error: --chunk-size is per_sample's chunk "
                                       "size, >= 1, with --per-sample (got 3 without it)\n")


@pytest.mark.parametrize("argv, message", [
    (["--chunk-size", "0"], "--chunk-size is per_sample's chunk size, >= 1, with --per-sample "
                            "(got 0)"),
    (["--k", "2"], "--per-sample times one batch of --micro-batch-sizes samples; it takes no "
                   "--k (got 2)"),
    (["--curvature"], "--curvature and --per-sample are different benches; choose one"),
    (["--optimizers", "sgd", "--stats"], "--per-sample times each face's compute and "
     "per_sample, no implementation, optimizer or statistics; it takes no --optimizers sgd or "
     "--stats"),
    (["--implementations", "hostavg"], "--per-sample times each face's compute and per_sample, "
     "no implementation, optimizer or statistics; it takes no --implementations hostavg"),
])
def test_bench_per_sample_refuses_what_it_cannot_honour_in_one_line(argv, message, capsys):
    assert main(["bench", "--per-sample", "--models", "logreg", *argv]) == 2
    assert capsys.readouterr().err == f"hostavg bench: error: {message}\n"


@pytest.mark.slow  # two fresh processes
def test_per_sample_memory_at_a_chunk_of_64_is_a_fraction_of_the_whole_batch_as_one():
    samples = 1024
    (face, *_) = bench.faces(bench.keras_backend())
    chunked, whole = bench_per_sample.memory(bench.Config("logreg", samples, 1), faces=(face,),
                                             out=lambda line: None, progress=False)
    assert (chunked["chunk_size"], whole["chunk_size"]) == (
        bench_per_sample.MEMORY_CHUNK_SIZE, samples)
    gradients = LOGREG_PARAMETERS * 4 * samples  # 31 MiB of float32 per-sample gradients
    assert whole["gradients_bytes"] == gradients
    for row in (chunked, whole):
        assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] >= 0
        assert row["parameters"] == LOGREG_PARAMETERS
    # As one chunk, what a call holds per sample exists for every sample at once (the kernel's
    # gradient is not formed, a Dense or MatMul being tapped, but its input and the loss's
    # gradient at its output are); at a chunk of 64, one chunk's (1/16 of it) and what a
    # call needs besides (a compute of the batch, for its mean gradient): well under a
    # quarter of the gradients, and of the whole batch's.
    assert chunked["peak_bytes"] < gradients / 4, chunked
    assert whole["peak_bytes"] > 3 * chunked["peak_bytes"], (whole, chunked)
