"""NumPy's BLAS in one thread while hostavg works (hostavg.core.blas): within a step, a hook
and hostavg's own BLAS calls see one thread; a step that makes neither leaves the count
alone; afterwards, also after a step that raises, the user's count is back; a second
thread's hold keeps it at one until the last one leaves."""

import contextlib
import threading

import pytest
from test_trainer import Case
from threadpoolctl import threadpool_info, threadpool_limits

import hostavg
from hostavg.core import blas
from hostavg.core import curvature, gradients
from hostavg.core.blas import blas_region, need_one_blas_thread, one_blas_thread


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


@contextlib.contextmanager
def _another_thread_within(context):
    """The block runs while another thread is within ``context()``, which it leaves after."""
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with context():
            entered.set()
            leave.wait(10)
    other = threading.Thread(target=hold)
    other.start()
    try:
        assert entered.wait(10)
        yield
    finally:
        leave.set()
        other.join()


def test_one_thread_holds_until_the_last_holder_leaves(two_threads):
    with _another_thread_within(one_blas_thread):
        with one_blas_thread():
            assert set(_threads()) == {1}
        assert set(_threads()) == {1}  # the other thread still holds it
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
    assert blas._held["regions"] == 0
    # taken: given back at once; given back: left at one, for the next hold to give back
    assert set(_threads()) == ({2} if where == "taken" else {1})
    with one_blas_thread():
        assert set(_threads()) == {1}
    assert set(_threads()) == {2}


def test_a_step_that_calls_no_blas_and_no_hook_of_the_users_leaves_the_count_alone(
        two_threads, monkeypatch):
    """One micro-batch, its norms from the session, the default watches: setting the count
    down and back cost such a step 30-130 us. Four micro-batches' statistics call BLAS."""
    setting, calls = blas._as_controller, []
    monkeypatch.setattr(blas, "_as_controller", lambda action: (calls.append(action),
                                                                setting(action)))
    case = Case()
    for _ in range(2):
        case.trainer.step(case.sess, case.feeds[:1])
    assert calls == []
    case.trainer.step(case.sess, case.feeds)
    assert len(calls) == 2  # held, then given back
    assert set(_threads()) == {2}


def test_hostavgs_own_blas_calls_in_a_step_run_in_one_thread(two_threads, monkeypatch):
    dot, seen = gradients._blocked_dot, []

    def watched(flat):
        out = dot(flat)
        seen.append(_threads())
        return out
    monkeypatch.setattr(gradients, "_blocked_dot", watched)
    case = Case()
    case.trainer.step(case.sess, case.feeds)
    assert seen and all(threads == [1] * len(threads) for threads in seen)
    assert set(_threads()) == {2}


def test_a_regions_hold_lasts_until_the_last_region_ends_and_none_is_taken_outside(two_threads):
    need_one_blas_thread()  # outside every region: nothing
    assert set(_threads()) == {2}
    with _another_thread_within(blas_region):  # a region that never needs it
        with blas_region():
            need_one_blas_thread()
            assert set(_threads()) == {1}
        assert set(_threads()) == {1}  # the other thread's region is still open
    assert set(_threads()) == {2}
    assert (blas._held["regions"], blas._held["held"]) == (0, False)


def test_a_region_that_raises_gives_the_count_back(two_threads):
    with pytest.raises(ValueError, match="in the region"):
        with blas_region():
            need_one_blas_thread()
            assert set(_threads()) == {1}
            raise ValueError("in the region")
    assert set(_threads()) == {2}
    assert (blas._held["regions"], blas._held["held"]) == (0, False)


def test_the_hooks_of_step_together_see_one_thread(two_threads):
    seen = Seen()
    case = Case(hooks=[seen])
    hostavg.step_together(case.sess, [(case.trainer, case.feeds)])
    assert seen.seen and all(threads == [1] * len(threads) for threads in seen.seen)
    assert set(_threads()) == {2}


def test_a_subclass_of_a_watch_that_calls_blas_itself_sees_one_thread(two_threads):
    """hostavg's own watches take no hold of their own; a subclass of one may add BLAS calls."""
    class Mine(hostavg.hooks.WatchOutliers):
        def on_micro_batch(self, micro):
            self.seen.append(_threads())
            return super().on_micro_batch(micro)
    mine = Mine()
    mine.seen = []
    case = Case(hooks=[mine])
    case.trainer.step(case.sess, case.feeds[:1])
    assert mine.seen and all(threads == [1] * len(threads) for threads in mine.seen)


def test_curvatures_trace_probes_run_in_one_thread(two_threads, monkeypatch):
    """Each Hutchinson probe's dot z . Hz is taken right after its product returns."""
    hutchinson, seen = curvature.hutchinson, []

    def watched(product, dim, samples, rng):
        def probed(v):
            out = product(v)
            seen.append(_threads())
            return out
        return hutchinson(probed, dim, samples, rng)
    monkeypatch.setattr(curvature, "hutchinson", watched)
    case = Case()
    case.trainer.curvature(case.sess, case.model.feed(case.data))
    assert seen and all(threads == [1] * len(threads) for threads in seen)
    assert set(_threads()) == {2}
