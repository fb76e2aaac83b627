"""Multi-worker training over real MPI: two ranks on loopback, started by mpiexec."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import models
import numpy as np
import pytest

HERE = Path(__file__).parent
MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install -e '.[mpi]'")]
# Open MPI refuses to run as root unless told; CI runs as root.
ENV = dict(models.ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def mpiexec(*args, ranks=2):
    return subprocess.Popen([MPIEXEC, "--oversubscribe", "-n", str(ranks), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(proc, timeout=120) -> subprocess.CompletedProcess:
    """Waits for an mpiexec; past ``timeout`` ends it with SIGTERM (so that it ends its ranks: a
    SIGKILL would leave them running) and fails."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def mpirun(*args, ranks=2, timeout=120):
    start = time.time()
    run = finish(mpiexec(*args, ranks=ranks), timeout)
    return run, time.time() - start


def alone(*args):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=120)


KINDS = ("dense", "sparse", "stack", "uneven", "scalar", "overlap", "keras", "frozen")


def test_two_ranks_equal_one_rank_with_all_micro_batches_and_agree_bitwise(tmp_path):
    # Every kind in one process each way: TensorFlow starts twice, not eight times.
    script = HERE / "mpi_script.py"
    one = alone(script, ",".join(KINDS), tmp_path / "one")
    assert one.returncode == 0, one.stderr
    two, _ = mpirun(sys.executable, script, ",".join(KINDS), tmp_path / "two")
    assert two.returncode == 0, two.stderr
    for kind in KINDS:
        want = dict(np.load(tmp_path / f"one-{kind}-rank0.npz"))
        ranks = [dict(np.load(tmp_path / f"two-{kind}-rank{r}.npz")) for r in (0, 1)]
        for name in set(want) - {"forward_passes"}:  # a rank runs only its own micro-batches forward
            where = f"{kind}: {name}"
            np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=where)
            np.testing.assert_allclose(ranks[0][name], want[name], atol=1e-5, rtol=0, err_msg=where)
        assert ranks[0]["global_step"] == 8, kind


def test_a_nan_on_one_rank_is_named_everywhere_and_the_job_fails(tmp_path):
    run, seconds = mpirun(sys.executable, HERE / "mpi_script.py", "nan", tmp_path / "nan")
    assert run.returncode != 0 and seconds < 60
    assert ("the step failed on 1 of 2 ranks and nothing was applied on any: rank 1: step, "
            "micro-batch 2 of 3 (samples 27:36): non-finite gradients in 'hidden/kernel'") in run.stderr


@pytest.mark.parametrize("mode", ["raise", "die"])
def test_a_rank_that_raises_or_dies_mid_step_ends_the_job_within_60_seconds(mode, tmp_path):
    run, seconds = mpirun(sys.executable, HERE / "mpi_script.py", mode, tmp_path / mode)
    assert run.returncode != 0, run.stdout
    assert seconds < 60
    if mode == "raise":
        assert "rank 1: RuntimeError: a hook broke on purpose" in run.stderr


def test_hostavg_train_on_two_ranks_matches_one_process(tmp_path):
    args = ["train", "--dataset", "digits", "--epochs", "2", "--quiet"]
    hostavg = [sys.executable, "-m", "hostavg"]
    two, _ = mpirun(*hostavg, *args, "--json", tmp_path / "two.json")
    assert two.returncode == 0, two.stderr
    one = alone("-m", "hostavg", *args, "--json", tmp_path / "one.json")
    assert one.returncode == 0, one.stderr
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (a["steps"], a["samples"]) == (b["steps"], b["samples"])
    assert b["test_loss"] == pytest.approx(a["test_loss"], abs=1e-5)


def test_two_ranks_resume_from_rank_0s_checkpoints(tmp_path):
    hostavg = [sys.executable, "-m", "hostavg", "train", "--dataset", "digits", "--quiet",
               "--checkpoint-dir", tmp_path / "ckpt"]
    first, _ = mpirun(*hostavg, "--epochs", "1")
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [  # the start, the end
        "ckpt-0000000000.npz", "ckpt-0000000006.npz"]
    resumed, _ = mpirun(*hostavg, "--epochs", "2", "--json", tmp_path / "resumed.json")
    assert resumed.returncode == 0, resumed.stderr
    straight, _ = mpirun(sys.executable, "-m", "hostavg", "train", "--dataset", "digits",
                         "--quiet", "--epochs", "2", "--json", tmp_path / "straight.json")
    assert straight.returncode == 0, straight.stderr
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("resumed", "straight"))
    assert a["steps"] == b["steps"] == 12 and a["test_loss"] == b["test_loss"]


def test_misconfigured_ranks_raise_the_same_error_everywhere_and_stay_in_step(tmp_path):
    run, seconds = mpirun(sys.executable, HERE / "mpi_script.py", "misconfigured", tmp_path / "m")
    assert run.returncode == 0, run.stderr
    said = [sorted(line.split(" caught: ", 1)[1] for line in run.stdout.splitlines()
                   if line.startswith(f"rank {r} caught: ")) for r in (0, 1)]
    assert said[0] == said[1] and len(said[0]) == 4, run.stdout
    for want in [
            "the ranks' models differ, so nothing was changed on any: rank 1 has variable "
            "'extra' ((2,) float32), which rank 0 lacks. Build the same graph and Trainer on every "
            "rank",
            "variable 'w' is (4, 4) float32 on rank 1, (4, 3) float32 on rank 0; trained variable "
            "'w' is (4, 4) float32 on rank 1, (4, 3) float32 on rank 0",
            "the step failed on 1 of 2 ranks and nothing was applied on any: rank 1: step takes a "
            "list of feed dicts, one per micro-batch, got dict",
            "the ranks give different values to 'lr:0' on ranks 0 and 1, which the train op "
            "reads; nothing was applied on any"]:
        assert any(want in s for s in said[0]), (want, said[0])
    w = [np.load(tmp_path / f"m-misconfigured-rank{r}.npz")["w"] for r in (0, 1)]
    np.testing.assert_array_equal(w[0], w[1])
    np.testing.assert_allclose(w[0], 1 - 3 * 0.1 / 3, rtol=1e-6)  # three steps of lr 0.1 applied


@pytest.mark.parametrize("mode", ["sigterm", "exit"])
def test_sigterm_or_sys_exit_on_one_rank_during_fit_ends_the_job(mode, tmp_path):
    start = time.time()
    proc = mpiexec(sys.executable, HERE / "mpi_script.py", mode, tmp_path / mode)
    if mode == "sigterm":
        for line in proc.stdout:
            if line.startswith("rank 1 pid ") and line.split()[-1] == "3":
                os.kill(int(line.split()[3]), signal.SIGTERM)
                break
    run = finish(proc)
    assert run.returncode != 0 and time.time() - start < 90, run
    left = "SystemExit: 143" if mode == "sigterm" else "SystemExit: 3"
    assert f"hostavg: rank 1 of 2 left a step or fit on its own ({left}); aborting the MPI job" \
        in run.stderr, run.stderr


def caught(stdout: str, rank: int) -> list[str]:
    return [line.split(" caught: ", 1)[1] for line in stdout.splitlines()
            if line.startswith(f"rank {rank} caught: ")]


@pytest.mark.parametrize("kind,want", [
    # Rank 1 finished its 2 batches and exited; rank 0 waited forever in its third step.
    ("sizes", "the ranks run fit with different data or arguments, so nothing was trained on any: "
              "samples 64 on rank 0, 32 on rank 1; batches per epoch 4 on rank 0, 2 on rank 1. "
              "fit splits each batch between the ranks: give every rank the same data, arguments "
              "and checkpoint_dir"),
    # Batches of unknown number: found where rank 1's epoch ends and rank 0 steps on.
    ("batches", "the ranks are out of step: rank 0 is at a step, rank 1 is at the end of epoch 1 "
                "of fit; every rank must make the same calls (fit: on the same data, with the "
                "same arguments), with sessions made alike"),
])
def test_ranks_with_different_data_raise_the_same_error_and_stay_in_step(tmp_path, kind, want):
    run, seconds = mpirun(sys.executable, HERE / "mpi_script.py", kind, tmp_path / kind,
                          timeout=90)
    assert run.returncode == 0 and seconds < 60, (seconds, run.stdout, run.stderr)
    said = [caught(run.stdout, r) for r in (0, 1)]
    assert all(len(s) == 1 and s[0].endswith(want) for s in said), said
    # Both ranks went on together: the failed fit applied the same steps on each.
    steps = [line.split(" global step ")[1] for line in run.stdout.splitlines()
             if line.startswith("rank ") and " caught: " not in line and " global step " in line]
    assert len(steps) == 2 and len(set(steps)) == 1, run.stdout
