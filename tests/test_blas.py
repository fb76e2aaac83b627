"""NumPy's BLAS in one thread while hostavg works (hostavg.core.blas): within a step, a hook
sees one thread; afterwards, also after a step that raises, the user's count is back; a
second thread's hold keeps it at one until the last one leaves."""

import threading

import pytest
from test_trainer import Case
from threadpoolctl import threadpool_info, threadpool_limits

import hostavg
from hostavg.core import blas
from hostavg.core.blas import one_blas_thread


def _threads() -> list:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.fixture
def two_threads():
    """NumPy's BLAS at two threads for the test (what one thread must be told from)."""
    if not _threads():
        pytest.skip("NumPy has no BLAS that threadpoolctl can set")
    with threadpool_limits(limits=2, user_api="blas"):
        if set(_threads()) != {2}:
            pytest.skip("this BLAS will not run two threads")
        yield


class Seen:
    """Records the BLAS's threads in each micro-batch; raises in one when told to."""

    def __init__(self, fail: bool = False):
        self.seen, self.fail = [], fail

    def on_micro_batch(self, micro):
        self.seen.append(_threads())
        if self.fail:
            raise RuntimeError("a hook that fails")


def test_a_step_runs_numpys_blas_in_one_thread_and_gives_the_count_back(two_threads):
    seen = Seen()
    case = Case(hooks=[seen])
    case.trainer.step(case.sess, case.feeds)
    assert seen.seen and all(threads == [1] * len(threads) for threads in seen.seen)
    assert set(_threads()) == {2}
    case.trainer.compute(case.sess, case.feeds[0])
    case.trainer.per_sample(case.sess, case.feeds[0])
    assert set(_threads()) == {2}


def test_a_step_that_raises_gives_the_count_back_too(two_threads):
    seen = Seen(fail=True)
    case = Case(hooks=[seen])
    with pytest.raises(RuntimeError, match="a hook that fails"):
        case.trainer.step(case.sess, case.feeds)
    assert seen.seen == [[1] * len(_threads())]
    assert set(_threads()) == {2}


def test_one_thread_holds_until_the_last_holder_leaves(two_threads):
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with one_blas_thread():
            entered.set()
            leave.wait(10)
    other = threading.Thread(target=hold)
    other.start()
    try:
        assert entered.wait(10)
        with one_blas_thread():
            assert set(_threads()) == {1}
        assert set(_threads()) == {1}  # the other thread still holds it
    finally:
        leave.set()
        other.join()
    assert set(_threads()) == {2}


@pytest.mark.parametrize("where", ["taken", "given back"])
def test_a_hold_interrupted_gives_the_count_back_then_or_at_the_next(two_threads, monkeypatch,
                                                                      where):
    """A Ctrl-C lands between two bytecodes: here just after the count is set to one, or just
    before it is set back."""
    setting, calls = blas._as_controller, []

    def interrupted(action):
        calls.append(action)
        if where == "taken" or len(calls) == 1:
            setting(action)
        if len(calls) == (1 if where == "taken" else 2):
            raise KeyboardInterrupt
    monkeypatch.setattr(blas, "_as_controller", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with one_blas_thread():
            pass
    monkeypatch.setattr(blas, "_as_controller", setting)
    assert blas._held["depth"] == 0
    # taken: given back at once; given back: left at one, for the next hold to give back
    assert set(_threads()) == ({2} if where == "taken" else {1})
    with one_blas_thread():
        assert set(_threads()) == {1}
    assert set(_threads()) == {2}
