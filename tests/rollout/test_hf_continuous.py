"""Continuous batching in the `hf` engine (`rollout.hf.continuous`): requests join the running decode,
rows of different lengths share one KV cache (right-aligned, per-row positions) and give what each
gives alone, finished rows leave at once, and pauses act on rows that are at different steps.

"Alone" is the same request decoded by itself. Tokens must be equal; log-probs equal to float32
round-off (a row's padding changes the shapes of the matmuls, not what is attended to).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.common.config.schema import HfConfig, ModelConfig, RolloutConfig
from fleetrl.rollout.engines import Request, SamplingParams, create_engine
from fleetrl.rollout.engines.kv_rows import Rows
from fleetrl.rollout.engines.sampling import _Job
from tests.rollout.test_server import wait_for
from tests.rollout.test_streaming import flipped, teacher_forced  # noqa: F401 - flipped is a fixture

LONG = 200  # steps of the long request: long enough for others to join and leave


def make_engine(path: str, **hf):
    return create_engine("hf", ModelConfig(path=path), RolloutConfig(hf=HfConfig(**hf)), "cpu", 0, num_threads=1)


def ids(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def ragged_prompts(engine) -> list[list[int]]:
    """1, 6, ~120 and ~330 tokens."""
    return [ids(engine, "x"), ids(engine, "17+25="), ids(engine, "what is 12*13? " * 8), ids(engine, "1+2=3, " * 47)]


def alone(engine, request: Request):
    return engine.loop.call(engine.generate(Request(request.prompt_ids, request.params)))


def started(engine) -> bool:
    """The decode thread took every pending request (they are rows now, or done)."""
    return engine._thread is not None and not engine._pending


def decoding(engine, prompt: list[int] | None = None, sampled: int = 1):
    """A LONG greedy request (default prompt "12+34="), returned once it has sampled ``sampled`` tokens: waiting
    by progress, not by polling or sleeping, leaves a fast box no time to finish it before the test acts (200
    steps take ~0.1 s here)."""
    count, going = [0], threading.Event()

    def on_token(tokens: list[int]) -> None:  # the decode thread, as it streams the row's tokens
        count[0] += len(tokens)
        if count[0] >= sampled:
            going.set()

    prompt = ids(engine, "12+34=") if prompt is None else prompt
    future = engine.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=LONG), on_token=on_token))
    assert going.wait(30), f"the long request sampled {count[0]} of {sampled} tokens in 30 s"
    return future


def staggered(engine, requests: list[Request], gap_s: float = 0.01):
    """Submit the requests one after another, each once the one before has joined the rows, so that
    each merges into a running cache at another step; returns the generations."""
    futures = []
    for request in requests:
        futures.append(engine.submit(request))
        wait_for(lambda: started(engine), what="the request to join")
        time.sleep(gap_s)
    return [f.result(60) for f in futures]


def assert_same(got, expected):
    assert got.token_ids == expected.token_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)
    assert got.finish_reason == expected.finish_reason and got.text == expected.text


# ------------------------------------------------------------------------------- the cache rows


def test_merged_rows_step_like_each_alone(engine):
    """Rows prefilled apart (1 and 330 tokens, then 6 and 120), merged, stepped: each row's logits are
    those it gets alone; a row leaving trims the columns that only it used."""
    prompts = ragged_prompts(engine)
    jobs = [_Job(Request(p, SamplingParams(temperature=0, max_new_tokens=4)), None, None) for p in prompts]
    token_R = torch.tensor([5, 7, 9, 11])

    def stepped(rows: Rows, tokens: torch.Tensor) -> torch.Tensor:
        engine._step(rows, tokens)
        return rows.logits_RV

    with torch.inference_mode():
        single = [stepped(engine._prefill([job]), token_R[i : i + 1])[0] for i, job in enumerate(jobs)]
        rows = engine._prefill([jobs[0], jobs[3]]).merge(engine._prefill([jobs[1], jobs[2]]))
        assert [job.request.prompt_ids for job in rows.jobs] == [prompts[0], prompts[3], prompts[1], prompts[2]]
        assert rows.mask_RT.shape[1] == len(prompts[3]) == rows.cache.get_seq_length()
        assert rows.mask_RT.sum(1).tolist() == [len(prompts[i]) for i in (0, 3, 1, 2)]
        merged = stepped(rows, token_R[[0, 3, 1, 2]])
        for row, i in enumerate((0, 3, 1, 2)):
            assert torch.allclose(merged[row], single[i], atol=1e-5), f"row {row} (prompt {i})"

        kept = rows.keep(torch.tensor([True, False, True, True]))  # the 330-token row leaves
        assert kept.mask_RT.shape[1] == len(prompts[2]) + 1 == kept.cache.get_seq_length()
        assert bool(kept.mask_RT[:, 0].any())  # no column is padding in every row
        after = stepped(kept, torch.tensor([3, 4, 6]))
        for row, i in enumerate((0, 1, 2)):
            alone_rows = engine._prefill([jobs[i]])
            engine._step(alone_rows, token_R[i : i + 1])
            assert torch.allclose(after[row], stepped(alone_rows, torch.tensor([[3, 4, 6][row]]))[0], atol=1e-5)


# ------------------------------------------------------------------------------------ joining


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "waves"])
def test_a_request_joins_the_running_decode(tiny_model_dir, continuous):
    engine = make_engine(tiny_model_dir, continuous=continuous)
    try:
        long = decoding(engine)
        short = engine.submit(Request(ids(engine, "5+5="), SamplingParams(temperature=0, max_new_tokens=3)))
        short.result(60)
        if continuous:  # it joined the running rows: 3 steps, while the long one has hundreds left
            assert not long.done()
            assert len(long.result(60).token_ids) == LONG
        else:  # waves: it waited for the long one's wave to end
            assert long.done()
        assert short.result() == alone(
            engine, Request(ids(engine, "5+5="), SamplingParams(temperature=0, max_new_tokens=3))
        )
    finally:
        engine.close()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0, max_new_tokens=24), SamplingParams(temperature=0.8, top_k=30, max_new_tokens=24)],
    ids=["greedy", "seeded"],
)
def test_ragged_rows_give_what_each_gives_alone(engine, params):
    """Prompts of 1 to ~330 tokens joining a running decode one by one, with per-request seeds."""
    requests = [
        Request(p, dataclasses.replace(params, seed=None if params.greedy else 100 + i))
        for i, p in enumerate(ragged_prompts(engine))
    ]
    lead = Request(ids(engine, "12+34="), SamplingParams(temperature=0, max_new_tokens=80))  # the running row
    outs = staggered(engine, [lead] + requests)
    for request, out in zip(requests, outs[1:]):
        assert_same(out, alone(engine, request))
    together = engine.loop.call(engine.generate_many(requests))  # one prefill of all four, then one batch
    for request, out in zip(requests, together):
        assert_same(out, alone(engine, request))


def test_rows_of_other_sampling_settings_share_the_batch(engine):
    prompt = ids(engine, "7+8=")
    requests = [
        Request(prompt, SamplingParams(temperature=0, max_new_tokens=12)),
        Request(prompt, SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=12, seed=5)),
        Request(
            prompt, SamplingParams(temperature=0.7, top_k=5, max_new_tokens=12, seed=6, stop_token_ids=(40, 41, 42))
        ),
    ]
    together = engine.loop.call(engine.generate_many(requests))
    for request, out in zip(requests, together):
        assert_same(out, alone(engine, request))


def test_finished_rows_leave_without_changing_the_others(engine):
    """Rows that end at different steps (1, 2, 5 tokens; a stop string; eos) leave the cache as they end;
    the long rows' tokens and log-probs stay those they give alone."""
    prompts = ragged_prompts(engine)
    full = alone(engine, Request(prompts[1], SamplingParams(max_new_tokens=30, seed=3)))
    stop = engine.tokenizer.decode(full.token_ids[4:6])
    requests = [
        Request(prompts[i % 4], SamplingParams(max_new_tokens=k, seed=i)) for i, k in enumerate((1, 2, 5, 30, 30))
    ]
    requests.append(Request(prompts[1], SamplingParams(max_new_tokens=30, seed=3, stop=(stop,))))
    requests.append(Request(prompts[3], SamplingParams(max_new_tokens=60, seed=9, stop_token_ids=(2,))))
    kept = []
    iterate = engine._iterate
    engine._iterate = lambda rows, jobs: kept.append(len(rows) + len(jobs)) or iterate(rows, jobs)
    try:
        together = engine.loop.call(engine.generate_many(requests))
    finally:
        del engine._iterate
    for request, out in zip(requests, together):
        assert_same(out, alone(engine, request))
    assert together[-2].finish_reason == "stop" and len(together[-2].token_ids) < 30
    # a row takes part in step t while it has not ended before it: the 1-token row leaves after step 1
    assert kept == [sum(len(out.token_ids) >= t for out in together) for t in range(1, len(kept) + 1)]
    assert kept[:2] == [7, 6]


def test_max_rows_bounds_the_batch(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_rows=2)
    sizes = []
    iterate = engine._iterate
    engine._iterate = lambda rows, jobs: sizes.append(len(rows) + len(jobs)) or iterate(rows, jobs)
    try:
        requests = [
            Request(p, SamplingParams(max_new_tokens=4 + 3 * i, seed=i)) for i, p in enumerate(ragged_prompts(engine))
        ]
        outs = engine.loop.call(engine.generate_many(requests))
        assert max(sizes) == 2 and len(sizes) > max(r.params.max_new_tokens for r in requests)
        for request, out in zip(requests, outs):
            assert_same(out, alone(engine, request))
    finally:
        engine.close()


# ------------------------------------------------------------------------------------- pauses


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_pause_with_rows_at_different_steps(tiny_model_dir, flipped, mode):  # noqa: F811 - the fixture
    """A weight update while two rows run, the second joined later: each row's tokens switch version
    at its own step; before it the old weights' log-probs, after it (recompute) the new weights'."""
    engine = make_engine(tiny_model_dir)
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts = [ids(engine, "12+34="), ids(engine, "what is 12*13? " * 4)]
    try:
        # each row joins once the one before has sampled 3 tokens: by progress, not by time (a fast box finished
        # the first row within two fixed 50-ms sleeps)
        futures = [decoding(engine, prompt, sampled=3) for prompt in prompts]

        def load():
            engine.update_weights(flipped.state_dict().items())
            return 1

        assert engine.loop.call(engine.swap_weights(load, mode)) == 1
        first, second = (f.result(60) for f in futures)
        switch = [out.versions.index(1) for out in (first, second)]
        assert 0 < switch[1] < switch[0], switch  # the first row had sampled more when the update came
        for prompt, out, k in zip(prompts, (first, second), switch):
            n = len(out.token_ids)
            assert k < n and out.versions == [0] * k + [1] * (n - k)
            assert torch.allclose(
                teacher_forced(old, prompt, out.token_ids[:k]), torch.tensor(out.logprobs[:k]), atol=1e-4
            )
            if mode == "recompute":
                new = teacher_forced(flipped, prompt, out.token_ids)[k:]
                assert torch.allclose(new, torch.tensor(out.logprobs[k:]), atol=1e-4)
    finally:
        engine.close()


def test_a_pause_right_after_a_resume_is_acknowledged_by_the_parked_rows(tiny_model_dir):
    """Two weight updates back to back (CI, issue 24's cluster lane): the resume of the first and the pause of
    the next both come before the parked decode thread wakes. It must still tell the second pause that
    nothing runs; it used to wait with its rows for a resume that waited for it (the rollout stopped)."""
    engine = make_engine(tiny_model_dir)
    try:
        long = decoding(engine)
        engine.loop.call(engine.pause("keep"), timeout=30)  # parked with its row

        async def resume_then_pause():
            with engine._cv:  # (reentrant) the decode thread wakes only after both
                await engine.resume(None, "keep")
                second = asyncio.ensure_future(engine.pause("keep"))
                await asyncio.sleep(0)  # the pause is set and its event cleared, under the lock
            await second

        engine.loop.call(resume_then_pause(), timeout=30)
        assert not long.done()
        engine.loop.call(engine.resume(None, "keep"))
        out = long.result(60)
        assert len(out.token_ids) > 0 and out.versions == [0] * len(out.token_ids)
    finally:
        engine.close()


def test_finish_pause_admits_nobody_until_the_rows_end(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    try:
        long = decoding(engine)
        paused = engine.loop.submit(engine.pause("finish"))
        wait_for(lambda: engine._pause_mode == "finish", what="the pause")
        late = engine.submit(Request(ids(engine, "5+5="), SamplingParams(temperature=0, max_new_tokens=3)))
        paused.result(60)  # returns once the running row is done
        assert long.done() and not late.done() and len(engine._pending) == 1
        engine.loop.call(engine.resume(None, "finish"))
        assert late.result(60).versions == [0] * len(late.result().token_ids)
    finally:
        engine.close()


def test_hf_settings_from_config():
    from fleetrl.common.config import load_config

    cfg = load_config(None, ["rollout.hf.continuous=false", "rollout.hf.max_rows=16"])
    assert cfg.rollout.hf == HfConfig(continuous=False, max_rows=16)
    assert load_config(None, []).rollout.hf == HfConfig(continuous=True, max_rows=None)
    with pytest.raises(ValueError, match=r"rollout.hf.max_rows=0 must be >= 1"):
        load_config(None, ["rollout.hf.max_rows=0"])
