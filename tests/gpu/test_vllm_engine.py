"""The `vllm` engine on a GPU, against a float32 HF forward of the same weights.

Skipped without a CUDA GPU or without vLLM; `scripts/gpu_check.sh` builds the environment and runs
these. The model is the ``small`` preset (head size 32, which vLLM's attention kernels support;
``tiny`` has 16), in float32 so that vLLM and HF agree closely. FLEETRL_GPU_MODEL_DIR points at a
prebuilt one (the script builds it), else the fixture builds it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from transformers import AutoModelForCausalLM  # noqa: E402

from fleetrl.common.config.schema import ModelConfig, RolloutConfig, VllmConfig  # noqa: E402
from fleetrl.learner.init_model import init_model  # noqa: E402
from fleetrl.rollout.engines import SamplingParams, create_engine  # noqa: E402

pytestmark = pytest.mark.gpu

EOS = 2
PROMPTS = ["1+2=", "17+25=", "x", "what is 12*13? answer: "]
# vLLM's float32 kernels and HF's float32 forward differ in summation order (and TF32 matmuls).
ATOL = 1e-2


def rollout_cfg(**sampling) -> RolloutConfig:
    return RolloutConfig(vllm=VllmConfig(gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=512), **sampling)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    prebuilt = os.environ.get("FLEETRL_GPU_MODEL_DIR")
    return prebuilt or str(init_model(tmp_path_factory.mktemp("models") / "small", preset="small", seed=0))


@pytest.fixture(scope="module")
def new_model_dir(tmp_path_factory) -> str:
    return str(init_model(tmp_path_factory.mktemp("models") / "small-seed1", preset="small", seed=1))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = create_engine("vllm", ModelConfig(path=model_dir, dtype="float32"), rollout_cfg(), "cuda", 0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()


def max_logprob_error(model, prompt_ids, groups, temperature: float) -> float:
    """Largest |vLLM log-prob - teacher-forced HF log_softmax(z / T)| over all sampled tokens."""
    worst = 0.0
    for prompt, group in zip(prompt_ids, groups):
        for sample in group:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + sample.token_ids], device="cuda")).logits[0].float()
            scores = logits[len(prompt) - 1 : -1] / (temperature or 1.0)
            expected = scores.log_softmax(-1).gather(1, torch.tensor(sample.token_ids, device="cuda")[:, None])
            worst = max(worst, (torch.tensor(sample.logprobs, device="cuda") - expected.squeeze(1)).abs().max().item())
    return worst


def test_groups_and_raw_logprobs_match_hf(engine, model_dir, prompt_ids):
    assert engine.mode == "raw_logprobs"
    for params in (
        SamplingParams(top_k=20, top_p=0.9, max_new_tokens=24, seed=0),
        SamplingParams(temperature=0, max_new_tokens=24),
    ):
        groups = engine.generate(prompt_ids, params, n=4)
        assert [len(g) for g in groups] == [4] * len(prompt_ids)
        for sample in (s for g in groups for s in g):
            assert 1 <= len(sample.token_ids) == len(sample.logprobs) <= 24
            assert sample.finish_reason in ("stop", "length")
        error = max_logprob_error(hf_model(model_dir), prompt_ids, groups, params.temperature)
        print(f"max |vllm - hf| log-prob error at T={params.temperature}: {error:.2e}")
        assert error < ATOL


def test_length_eos_stop_ids_and_stop_strings(engine, prompt_ids):
    short = [s for g in engine.generate(prompt_ids, SamplingParams(max_new_tokens=4, seed=1), n=8) for s in g]
    assert any(s.finish_reason == "length" for s in short)
    for s in short:
        assert len(s.token_ids) == 4 if s.finish_reason == "length" else s.token_ids[-1] == EOS

    greedy = SamplingParams(temperature=0, max_new_tokens=32)
    [[full]] = engine.generate([prompt_ids[0]], greedy, n=1)
    stop_id = next(t for t in full.token_ids[2:] if t != EOS)
    with_stop_id = SamplingParams(temperature=0, max_new_tokens=32, stop_token_ids=(stop_id,))
    [[cut]] = engine.generate([prompt_ids[0]], with_stop_id, 1)
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]

    decode = engine.tokenizer.decode
    printable = [t for t in full.token_ids[3:] if decode([t]).isascii() and decode([t]).isprintable()]
    if printable:
        stop = decode([printable[0]])
        [[cut]] = engine.generate([prompt_ids[0]], SamplingParams(temperature=0, max_new_tokens=32, stop=(stop,)), 1)
        assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]


def test_seed_reproducibility(engine, prompt_ids):
    def run(seed):
        groups = engine.generate(prompt_ids, SamplingParams(max_new_tokens=12, seed=seed), 2)
        return [(s.token_ids, s.logprobs) for g in groups for s in g]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_weight_updates(engine, model_dir, new_model_dir, prompt_ids):
    params = SamplingParams(max_new_tokens=16, seed=5)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    def greedy_tokens():
        return [g[0].token_ids for g in engine.generate(prompt_ids, greedy, 1)]

    before = greedy_tokens()
    new_state = AutoModelForCausalLM.from_pretrained(new_model_dir).state_dict()

    with pytest.raises(ValueError, match="unknown weight"):
        engine.update_weights([*new_state.items(), ("model.nope.weight", torch.zeros(1))])
    assert greedy_tokens() == before  # nothing was copied

    engine.update_weights(new_state.items())
    new_model = hf_model(new_model_dir)
    assert max_logprob_error(new_model, prompt_ids, engine.generate(prompt_ids, params, 2), 1.0) < ATOL
    hf_engine = create_engine("hf", ModelConfig(path=new_model_dir, dtype="float32"), RolloutConfig(), "cuda", 0)
    expected = hf_engine.generate(prompt_ids, greedy, 1)
    assert greedy_tokens() == [g[0].token_ids for g in expected] != before

    engine.load_weights_from_dir(model_dir)  # back to the original weights
    assert greedy_tokens() == before
    assert max_logprob_error(hf_model(model_dir), prompt_ids, engine.generate(prompt_ids, params, 2), 1.0) < ATOL


def test_processed_logprobs_engine_at_temperature(model_dir, prompt_ids):
    cfg = ModelConfig(path=model_dir, dtype="float32")
    with pytest.raises(ValueError, match="neither is the behaviour log-prob"):
        create_engine("vllm", cfg, rollout_cfg(temperature=0.7, top_k=20), "cuda", 0)
    engine = create_engine("vllm", cfg, rollout_cfg(temperature=0.7), "cuda", 0)
    try:
        assert engine.mode == "processed_logprobs"
        groups = engine.generate(prompt_ids, SamplingParams(temperature=0.7, max_new_tokens=16, seed=0), n=4)
        assert max_logprob_error(hf_model(model_dir), prompt_ids, groups, 0.7) < ATOL
        with pytest.raises(ValueError, match="top_k"):
            engine.generate(prompt_ids, SamplingParams(temperature=0.7, top_k=5), n=1)
    finally:
        engine.close()
