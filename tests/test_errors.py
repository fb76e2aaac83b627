"""hostavg's exceptions: ArgumentError and StepError under HostavgError, and every raising site
choosing one (an AST walk over hostavg/). Which face raises which for what is pinned in
tests/contract/test_contract_errors.py, on every backend."""

import ast
from pathlib import Path

import numpy as np
import pytest
from test_trainer import Case, unchanged

import hostavg
from hostavg.core import errors
from hostavg.engine.mpi import Distributed

PACKAGE = Path(__file__).parents[1] / "hostavg"
#: (module path, line) -> why it constructs the base class itself. None does: a site says
#: whether the caller's call was refused (ArgumentError) or running failed (StepError).
BASE_ALLOWED: dict = {}


def test_the_base_catches_both_and_only_argument_errors_are_value_errors():
    assert hostavg.ArgumentError.__mro__[1:3] == (hostavg.HostavgError, ValueError)
    assert hostavg.StepError.__mro__[1:3] == (hostavg.HostavgError, RuntimeError)
    assert not issubclass(hostavg.HostavgError, ValueError)
    assert not issubclass(hostavg.StepError, ValueError)
    for kind in (hostavg.ArgumentError, hostavg.StepError):
        error = kind("said")
        assert (error.culprits, error.culprit_rows, str(error)) == ((), [], "said")
    assert {"ArgumentError", "HostavgError", "StepError"} <= set(hostavg.__all__)


def _sites() -> list[str]:
    """Every construction of HostavgError itself in hostavg/ (a raise or a call), as
    ``path:line``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            target = node.exc if isinstance(node, ast.Raise) else node.func \
                if isinstance(node, ast.Call) else None
            name = getattr(target, "id", None) or getattr(target, "attr", None)
            if name == "HostavgError":
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return sorted(found)


def test_every_raising_site_says_argument_or_step():
    assert sorted(set(_sites()) - set(BASE_ALLOWED)) == []


def test_the_walk_finds_a_site_that_raises_the_base(tmp_path, monkeypatch):
    (tmp_path / "hostavg").mkdir()
    (tmp_path / "hostavg" / "m.py").write_text(
        "from hostavg.core import errors\n"
        "def f():\n    raise errors.HostavgError('x')\n"
        "def g():\n    raise HostavgError\n"
        "def h():\n    return HostavgError('y'), ArgumentError('z')\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "hostavg")
    assert _sites() == ["hostavg/m.py:3", "hostavg/m.py:5", "hostavg/m.py:7"]


@pytest.mark.parametrize("check,value", [
    (errors.positive_int, 0), (errors.non_negative_int, -1), (errors.positive_number, 0.0),
    (errors.non_negative_number, np.nan), (errors.flag, "yes")])
def test_the_argument_checks_raise_argument_errors(check, value):
    with pytest.raises(hostavg.ArgumentError, match=rf"^n must be .*, got {value!r}$"):
        check("n", value)
    with pytest.raises(hostavg.ArgumentError, match=r"^hooks must be a list of objects"):
        errors.object_list("hooks", 3, ("on_step",), "Clip()")


def test_within_a_step_an_argument_error_is_a_step_error_with_its_culprits():
    refused = hostavg.ArgumentError("gradients of the wrong shape")
    refused.culprit_rows = [3]
    with pytest.raises(hostavg.StepError, match="^gradients of the wrong shape$") as raised:
        with errors.within_step():
            raise refused
    assert raised.value.culprit_rows == [3]
    with pytest.raises(KeyError), errors.within_step():
        raise KeyError("other errors pass as they are")
    assert isinstance(errors.refused("fact", "advice"), hostavg.StepError)
    assert isinstance(errors.refused("fact", "advice", hostavg.ArgumentError),
                      hostavg.ArgumentError)


def test_a_tf1_step_in_a_closed_session_is_a_step_error_and_a_bad_feed_an_argument_error():
    case = Case()
    case.trainer.step(case.sess, case.feeds)
    x = case.model.inputs["x"]
    wide = [{**case.feeds[0], x: np.ones((10, 7), np.float32)}]
    unchanged(case, lambda: case.trainer.step(case.sess, wide), "has shape", hostavg.ArgumentError)
    case.sess.close()
    with pytest.raises(hostavg.StepError, match=r"^the session failed in the snapshot of the "
                                                r"rollback variables \(CancelledError: Session "
                                                r"has been closed\.\)$"):
        case.trainer.step(case.sess, case.feeds)


@pytest.mark.parametrize("own,want", [(hostavg.ArgumentError("refused"), hostavg.ArgumentError),
                                      (hostavg.StepError("failed"), hostavg.StepError),
                                      (RuntimeError("a hook's own"), hostavg.StepError)])
def test_over_mpi_a_failed_rank_s_error_keeps_its_kind(own, want):
    from mpi4py import MPI

    class Alone:
        advice = {"target_name": "model"}

    with pytest.raises(want, match=r"^the step failed on 1 of 1 ranks and nothing was applied "
                                   r"on any: rank 0: ") as raised:
        Distributed(MPI.COMM_SELF).combine(Alone(), None, own)
    assert raised.value.__cause__ is own
