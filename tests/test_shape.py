"""The shape check of .ci/shape.py: no function in hostavg/ over 60 code lines, no class
docstring over 30 lines, no module docstring over 20 (issue 30)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / ".ci" / "shape.py"


def test_hostavg_definitions_are_within_the_shape_limits():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "longest function:" in run.stdout


def test_shape_reports_each_excess_and_fails(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    module_doc = "\n".join(f"line {i}" for i in range(21))
    class_doc = "\n    ".join(f"line {i}" for i in range(31))
    (package / "long.py").write_text(
        f'"""{module_doc}"""\n\n\nclass C:\n    """{class_doc}"""\n\n\n'
        f'def f():\n    """Docstring lines are not code."""\n    # nor comments\n\n{body}\n')
    run = subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True)
    assert run.returncode == 1
    assert "over: 62 lines pkg/long.py:58 f" in run.stdout  # the def line and 61 assignments
    assert "over: 31 lines pkg/long.py:24 C" in run.stdout
    assert "over: 21 lines pkg/long.py\n" in run.stdout
