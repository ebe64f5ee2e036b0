"""The `vllm` engine on vLLM's async engine (CPU backend in the lane): behaviour log-probs against an
HF teacher-forced forward, greedy equality with the `hf` engine, stops, seeds, bad settings."""

from __future__ import annotations

import pytest

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.rollout.engines import Request, SamplingParams, create_engine
from tests.vllm.conftest import ATOL, DEVICE, hf_model, rollout_cfg, teacher_forced_logp

PROMPTS = ["12+34=", "7+8=", "hello world", "99+1="]


def encode(engine, texts=PROMPTS) -> list[list[int]]:
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def max_logprob_error(model, prompts, groups) -> float:
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for sample in group:
            ref = teacher_forced_logp(model, prompt, sample.token_ids)
            worst = max(worst, (ref - __import__("torch").tensor(sample.logprobs)).abs().max().item())
    return worst


def test_logprobs_equal_an_hf_teacher_forced_forward(vllm_engine, small_dir):
    prompts = encode(vllm_engine)
    groups = vllm_engine.generate_batch(prompts, SamplingParams(max_new_tokens=24, seed=3), 4)
    assert all(len(g) == 4 and all(1 <= len(s.token_ids) == len(s.logprobs) <= 24 for s in g) for g in groups)
    assert all(s.versions == [vllm_engine.version] * len(s.token_ids) for g in groups for s in g)
    assert max_logprob_error(hf_model(small_dir), prompts, groups) <= ATOL
    greedy = vllm_engine.generate_batch(prompts, SamplingParams(temperature=0, max_new_tokens=16), 1)
    assert max_logprob_error(hf_model(small_dir), prompts, greedy) <= ATOL  # greedy: log-probs at T = 1


def test_greedy_output_equals_the_hf_engine(vllm_engine, small_dir):
    prompts = encode(vllm_engine)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    hf = create_engine("hf", ModelConfig(path=small_dir, dtype="float32"), RolloutConfig(), "cpu", 0, num_threads=1)
    try:
        want = [[s.token_ids for s in g] for g in hf.generate_batch(prompts, params, 1)]
    finally:
        hf.close()
    assert [[s.token_ids for s in g] for g in vllm_engine.generate_batch(prompts, params, 1)] == want


def test_stop_ids_stop_strings_and_seeds(vllm_engine):
    [prompt] = encode(vllm_engine, ["12+34="])
    [[full]] = vllm_engine.generate_batch([prompt], SamplingParams(temperature=0, max_new_tokens=32), 1)
    assert full.finish_reason == "length" and len(full.token_ids) == 32
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    [[cut]] = vllm_engine.generate_batch(
        [prompt], SamplingParams(temperature=0, max_new_tokens=32, stop_token_ids=(stop_id,)), 1
    )
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: first + 1]  # the stop id is kept
    text = vllm_engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[6:8]
    if stop.strip():
        [[by_string]] = vllm_engine.generate_batch(
            [prompt], SamplingParams(temperature=0, max_new_tokens=32, stop=(stop,)), 1
        )
        assert by_string.finish_reason == "stop" and stop not in by_string.text and text.startswith(by_string.text)

    def sampled(seed):
        return [
            s.token_ids
            for g in vllm_engine.generate_batch([prompt], SamplingParams(max_new_tokens=12, seed=seed), 3)
            for s in g
        ]

    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)
    assert len(set(map(tuple, sampled(5)))) == 3  # sample j is seeded seed + j: the group is not one sample x3


def test_requests_stream_out_as_they_finish(vllm_engine):
    """Continuous batching: a short request submitted with a long one returns long before it."""
    import time

    [prompt] = encode(vllm_engine, ["7+8="])
    long = vllm_engine.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=400)))
    t0 = time.monotonic()
    short = vllm_engine.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=4))).result(60)
    short_s = time.monotonic() - t0
    assert len(short.token_ids) <= 4 and not long.done()
    long.result(120)
    assert time.monotonic() - t0 > short_s


def test_settings_vllm_cannot_give_exact_logprobs_for_are_refused(small_dir):
    with pytest.raises(ValueError, match="temperature=0.7 with top_k=20"):
        create_engine(
            "vllm", ModelConfig(path=small_dir, dtype="float32"), rollout_cfg(temperature=0.7, top_k=20), DEVICE, 0
        )


def test_a_request_that_does_not_fit_the_engine_mode_is_refused(vllm_engine):
    with pytest.raises(ValueError, match="raw log-probs"):
        vllm_engine.generate_batch([[5, 6]], SamplingParams(temperature=0.7), 1)


def test_closing_the_engine_leaves_no_error_at_interpreter_exit(small_dir):
    """A rollout process that closes its engine and exits prints no `Exception ignored in AsyncLLM.__del__`
    (vLLM's destructor running again at teardown, after its module globals are gone)."""
    import subprocess
    import sys

    from tests.vllm.conftest import DEVICE

    child = (
        "from fleetrl.common.config.schema import ModelConfig\n"
        "from fleetrl.rollout.engines import create_engine\n"
        "from tests.vllm.conftest import rollout_cfg\n"
        f"e = create_engine('vllm', ModelConfig(path={str(small_dir)!r}, dtype='float32'), rollout_cfg(), {DEVICE!r}, 0)\n"
        "e.close()\n"
        "print('closed')\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr[-3000:]
    assert "Exception ignored" not in out.stderr and "AsyncLLM.__del__" not in out.stderr, out.stderr[-3000:]
