"""Every process the tests start (scripts, mpiexec ranks, notebook kernels) imports this
checkout's hostavg, not another one installed in editable mode."""

import os
from pathlib import Path

ROOT = str(Path(__file__).parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT])
