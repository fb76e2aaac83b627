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
