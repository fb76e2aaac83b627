"""MPI ranks whose data differ: no rank waits forever; every rank raises the same error (issue 24,
item 3). Two ranks on loopback, started by mpiexec (see test_mpi.py)."""

import sys

import pytest
from test_mpi import HERE, MPIEXEC, mpirun

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install -e '.[mpi]'")]


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
