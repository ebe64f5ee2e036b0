"""The `hf` engine's admission window (`rollout.hf.admission_wait_ms`): requests that arrive one after another
join in one prefill; the wait is bounded from the oldest queued request (a stream of arrivals does not hold
it back); a close or a pause ends the wait at once. No test here times anything: each checks which requests
were prefilled together, or that a call returns at all (a wait that never ended would hang it past the
generous window given)."""

from __future__ import annotations

import pytest

from fleetrl.rollout.engines import Request, SamplingParams
from tests.rollout.test_hf_continuous import LONG, assert_same, ids, make_engine, started
from tests.rollout.test_server import wait_for

HOUR_MS = 60_000.0  # a window no test waits out: only a full batch, a close or a pause ends it


def prefill_sizes(engine) -> list[int]:
    """Record how many jobs each prefill of ``engine`` takes."""
    sizes: list[int] = []
    prefill = engine._prefill
    engine._prefill = lambda jobs: sizes.append(len(jobs)) or prefill(jobs)
    return sizes


def test_staggered_requests_join_in_one_prefill(tiny_model_dir):
    """Three requests sent one at a time, each after the one before is queued: one prefill of three (the
    window closes when they fill max_rows), and each gives what it gives through an engine without a window."""
    engine = make_engine(tiny_model_dir, admission_wait_ms=HOUR_MS, max_rows=3)
    sizes = prefill_sizes(engine)
    plain = make_engine(tiny_model_dir)
    requests = [Request(ids(engine, f"{a}+{a}="), SamplingParams(max_new_tokens=6, seed=a)) for a in (3, 14, 25)]
    try:
        futures = []
        for n, request in enumerate(requests, start=1):
            futures.append(engine.submit(request))
            if n < len(requests):  # held: the next one arrives while this one waits
                wait_for(lambda n=n: len(engine._pending) == n, what="the request to be held")
        outs = [f.result(60) for f in futures]
        assert sizes == [3]
        for request, out in zip(requests, outs):
            assert_same(out, plain.loop.call(plain.generate(request)))
    finally:
        engine.close()
        plain.close()


def test_arrivals_during_a_decode_join_together(tiny_model_dir):
    """While a long request decodes, two arrivals are held and then join in one prefill and one merge; the
    running row keeps decoding meanwhile and gives what it gives alone."""
    engine = make_engine(tiny_model_dir, admission_wait_ms=500.0)
    sizes = prefill_sizes(engine)
    plain = make_engine(tiny_model_dir)
    long = Request(ids(engine, "12+34="), SamplingParams(temperature=0, max_new_tokens=LONG))
    late = [Request(ids(engine, f"{a}+5="), SamplingParams(max_new_tokens=3, seed=a)) for a in (1, 2)]
    try:
        first = engine.submit(long)  # alone: admitted when its window closes
        wait_for(lambda: started(engine) and sizes == [1], what="the long request to start")
        futures = [engine.submit(r) for r in late]
        outs = [f.result(60) for f in futures]
        assert sizes == [1, 2]
        for request, out in zip([long, *late], [first.result(60), *outs]):
            assert_same(out, plain.loop.call(plain.generate(request)))
    finally:
        engine.close()
        plain.close()


def test_a_stream_of_arrivals_does_not_hold_the_first_back(tiny_model_dir):
    """The window runs from the oldest queued request: with requests arriving every few ms for far longer than
    the window, the first ones are admitted (and answered) while the stream still goes on."""
    engine = make_engine(tiny_model_dir, admission_wait_ms=50.0)
    sizes = prefill_sizes(engine)
    params = SamplingParams(max_new_tokens=2, seed=0)
    try:
        first = engine.submit(Request(ids(engine, "1+1="), params))
        rest = []
        while not first.done() and len(rest) < 5000:
            rest.append(engine.submit(Request(ids(engine, "2+2="), params)))
            wait_for(lambda n=len(rest): engine._pending or rest[n - 1].done(), what="the request to queue")
        assert first.done() and len(rest) < 5000, "the first request waited for the stream to end"
        [f.result(60) for f in rest]
        # Every request prefilled once. How many prefills that took depends on the box: a slow one can queue the
        # whole stream inside the first window and answer it before the next arrival, so the count is not checked.
        assert sum(sizes) == 1 + len(rest) and all(size >= 1 for size in sizes)
    finally:
        engine.close()


def test_close_during_the_window_fails_the_held_request(tiny_model_dir):
    engine = make_engine(tiny_model_dir, admission_wait_ms=HOUR_MS)
    held = engine.submit(Request(ids(engine, "1+1="), SamplingParams(max_new_tokens=2)))
    wait_for(lambda: engine._thread is not None and len(engine._pending) == 1, what="the request to be held")
    thread = engine._thread
    engine.close()  # joins the decode thread (30 s at most): it must not sit out the window
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        held.result(10)


def test_a_pause_during_the_window_parks_at_once(tiny_model_dir):
    engine = make_engine(tiny_model_dir, admission_wait_ms=HOUR_MS)
    try:
        held = engine.submit(Request(ids(engine, "1+1="), SamplingParams(max_new_tokens=2)))
        wait_for(lambda: engine._thread is not None and len(engine._pending) == 1, what="the request to be held")
        engine.loop.submit(engine.pause("keep")).result(20)  # parks instead of waiting out the window
        assert not held.done() and len(engine._pending) == 1
        engine.loop.call(engine.resume(None, "keep"))
    finally:
        engine.close()


def test_admission_wait_from_config():
    from fleetrl.common.config import load_config

    assert load_config(None, []).rollout.hf.admission_wait_ms == 0.0  # off by default: measured, no gain
    assert load_config(None, ["rollout.hf.admission_wait_ms=20"]).rollout.hf.admission_wait_ms == 20.0
    with pytest.raises(ValueError, match=r"rollout.hf.admission_wait_ms=-1.0 must be between 0"):
        load_config(None, ["rollout.hf.admission_wait_ms=-1"])
