"""The benchmark compares equal work, and its memory numbers say what the README claims."""

import json

import pytest

from hostavg import bench
from hostavg.cli import main


def test_bench_smallest_writes_json_and_every_implementation_ends_with_the_same_weights(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--grid", "smallest", "--no-memory", "--repeats", "2", "--stats",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"machine", "repeats", "configs"}
    (config,) = result["configs"]
    assert (config["model"], config["micro_batch_size"], config["k"]) == ("mlp-50k", 32, 4)
    assert set(config["median_s"]) == set(bench.IMPLEMENTATIONS)
    assert all(t > 0 for t in config["median_s"].values())
    assert config["ratio_to_in_graph"]["in-graph"] == 1.0
    assert max(config["max_weight_diff"].values()) < 1e-5, config["max_weight_diff"]


@pytest.mark.slow
def test_sum_mode_memory_does_not_grow_with_k_and_stack_mode_does():
    mib = 2 ** 20
    grad_bytes = 305_290 * 4
    sums = {k: bench.measure_memory(bench.Config("mlp-300k", 32, k), "hostavg") for k in (4, 64)}
    assert abs(sums[64] - sums[4]) <= 0.1 * sums[4] + mib, sums
    stack = {k: bench.measure_memory(bench.Config("mlp-300k", 32, k), "hostavg-stack")
             for k in (4, 64)}
    assert stack[64] - stack[4] > 0.8 * 60 * grad_bytes, stack


def test_bench_smallest_is_quick_says_what_it_does_and_shows_each_cells_spread(tmp_path, capsys):
    import time
    out = tmp_path / "bench.json"
    t0 = time.perf_counter()
    assert main(["bench", "--grid", "smallest", "--repeats", "5", "--json", str(out)]) == 0
    assert time.perf_counter() - t0 < 40  # no memory probes: no fresh TensorFlow processes
    printed = capsys.readouterr()
    assert printed.err.startswith(f"bench: timing mlp-50k micro=32 k=4 (1 of 1): 5 steps of each "
                                  f"of {len(bench.DEFAULT_IMPLEMENTATIONS)} implementations\n")
    assert "interquartile range" in printed.out and "memory not measured" in printed.out
    (config,) = json.loads(out.read_text())["configs"]
    assert "memory" not in json.loads(out.read_text())
    for name, iqr in config["iqr_s"].items():
        assert 0 <= iqr and f"ms ({iqr * 1e3:.1f})" in printed.out, name
