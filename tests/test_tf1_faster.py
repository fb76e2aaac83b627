"""hostavg.tf1.faster: the faster of two calls that compute the same, chosen on their first
calls by their median times, then kept."""

import threading
import time

import pytest

from hostavg.tf1.faster import Faster

CHOOSING = 2 * (Faster.WARM + Faster.TIMED)  # calls until a choice is made


def runs(slow: int):
    """Two calls returning their own name and noting it in ``ran``; run ``slow`` sleeps 5 ms."""
    ran = []

    def make(name):
        def run(x):
            ran.append(name)
            if name == slow:
                time.sleep(0.005)
            return name, x
        return run
    return ran, make(0), make(1)


@pytest.mark.parametrize("slow", [0, 1])
def test_the_calls_alternate_until_each_was_timed_then_only_the_faster_runs(slow):
    ran, first, second = runs(slow)
    faster = Faster(first, second)
    for i in range(CHOOSING):
        assert faster.chosen is None
        assert faster(i) == (i % 2, i)  # each call's own result, whichever ran it
    assert ran == [0, 1] * (Faster.WARM + Faster.TIMED)
    assert faster.chosen is (second if slow == 0 else first)
    assert faster.medians[slow] > 0.005 > faster.medians[1 - slow]
    del ran[:]
    assert [faster(i) for i in range(5)] == [(1 - slow, i) for i in range(5)]
    assert ran == [1 - slow] * 5


def test_untimed_warm_calls_do_not_count_so_a_slow_first_call_does_not_decide():
    calls = []

    def first(x):  # the slower from its third call on, very slow on its first
        calls.append(x)
        time.sleep(0.05 if len(calls) == 1 else 0.004)
        return x

    faster = Faster(first, lambda x: time.sleep(0.001) or x)
    for i in range(CHOOSING):
        faster(i)
    assert faster.medians[0] < 0.05 and faster.chosen is not first


def test_a_call_that_raises_is_not_timed_and_its_error_reaches_the_caller():
    ran, first, second = runs(1)

    def failing(x):
        if x == "bad":
            raise ZeroDivisionError("from the call")
        return second(x)

    faster = Faster(first, failing)
    for i in range(2 * Faster.WARM):
        faster(i)
    faster("x")  # first, timed
    with pytest.raises(ZeroDivisionError, match="from the call"):
        faster("bad")  # failing: raised, and not counted as one of its timed calls
    for i in range(CHOOSING):
        if faster.chosen is None:
            faster(i)
    assert faster.chosen is first
    assert ran.count(1) == Faster.WARM + Faster.TIMED  # its five timed calls all after the error


def test_two_threads_calling_it_get_their_own_results_and_one_choice():
    ran, first, second = runs(0)
    faster = Faster(first, second)
    start, out = threading.Barrier(2), {0: [], 1: []}

    def work(t):
        start.wait()
        for i in range(40):
            out[t].append(faster((t, i))[1])

    workers = [threading.Thread(target=work, args=(t,)) for t in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert out == {t: [(t, i) for i in range(40)] for t in (0, 1)}
    assert faster.chosen is second and len(ran) == 80
    assert ran[-10:] == [1] * 10
