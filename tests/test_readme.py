"""The README's quickstart runs as written."""

import re
from pathlib import Path


def test_readme_quickstart_runs(capsys):
    readme = Path(__file__).parents[1].joinpath("README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["res"].step == 5 and len(namespace["res"].micro) == 4
    assert len(namespace["history"].steps) == 20
    assert "micro-batch loss" in capsys.readouterr().out


def test_readme_keras_example_runs(capsys):
    readme = Path(__file__).parents[1].joinpath("README.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "hostavg.keras" in c
               and "Trainer(" in c and "comm=" not in c]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["res"].step == 2 and len(namespace["res"].micro) == 4
    assert len(namespace["history"].steps) == 20
    printed = capsys.readouterr().out
    assert "optimizer.iterations: 1" in printed and "'accuracy'" in printed


def test_docstring_examples_run():
    import doctest
    import importlib

    import numpy
    for name in ("core.accumulator", "engine.batches", "core.gradients", "core.split", "core.stats"):
        module = importlib.import_module(f"hostavg.{name}")
        result = doctest.testmod(module, extraglobs={"np": numpy}, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, name
