"""The `hf` engine's grouped-query attention on CPU (rollout/engines/attention.py): the same numbers as
transformers' ``sdpa`` bit for bit, on left-padded rows, prefill and cached decode steps alike; what
the engine loads; and what it refuses."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.learner.init_model import init_model
from fleetrl.rollout.engines import Request, SamplingParams, create_engine
from fleetrl.rollout.engines import hf as hf_engine
from fleetrl.rollout.engines.attention import ATTENTION, attention_for, sdpa_gqa


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> str:
    """The demo's preset: 6 query heads over 2 key/value heads."""
    return str(init_model(tmp_path_factory.mktemp("models") / "small", preset="small", seed=3))


def load(path: str, attention: str):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).eval()


def test_left_padded_prefill_and_cached_decode_equal_sdpa_bit_for_bit(small_dir):
    ours, stock = load(small_dir, ATTENTION), load(small_dir, "sdpa")
    assert ours.config.num_attention_heads != ours.config.num_key_value_heads  # grouped heads: the case at stake
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (4, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :6], mask[3, :13] = 0, 0  # left padding of different widths
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    caches, logits = [DynamicCache(config=m.config) for m in (ours, stock)], []
    with torch.inference_mode():
        for model, cache in zip((ours, stock), caches):
            logits.append(model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits)
        assert torch.equal(logits[0], logits[1])
        step_mask, step_pos = torch.cat([mask, torch.ones(4, 1, dtype=torch.long)], 1), pos[:, -1:] + 1
        token = logits[0][:, -1].argmax(-1, keepdim=True)
        steps = [
            model(input_ids=token, attention_mask=step_mask, position_ids=step_pos, past_key_values=cache).logits
            for model, cache in zip((ours, stock), caches)
        ]
    assert torch.equal(steps[0], steps[1])
    assert not torch.equal(steps[0][0], steps[0][1])  # the rows differ: a broken mask would not pass by luck


def test_the_cpu_engine_loads_it_and_samples_what_sdpa_samples(small_dir):
    engine = create_engine("hf", ModelConfig(path=small_dir), RolloutConfig(), "cpu", 0)
    assert engine.model.config._attn_implementation == ATTENTION
    stock = create_engine("hf", ModelConfig(path=small_dir), RolloutConfig(), "cpu", 0)
    stock.model.config._attn_implementation = "sdpa"  # what the engine ran before
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11)

    async def run(e):
        return await e.generate_many([Request(p, params) for p in prompts])

    try:
        a, b = asyncio.run(run(engine)), asyncio.run(run(stock))
    finally:
        engine.close()
        stock.close()
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]


def test_cuda_keeps_transformers_sdpa():
    assert attention_for(torch.device("cpu")) == ATTENTION
    assert attention_for(torch.device("cuda", 0)) == "sdpa"  # fused kernels take grouped heads only unmasked


def test_a_model_that_refuses_registered_attention_loads_with_its_default(small_dir, monkeypatch, caplog):
    real = AutoModelForCausalLM.from_pretrained
    calls = []

    def refusing(path, **kwargs):
        calls.append(kwargs.get("attn_implementation"))
        if "attn_implementation" in kwargs:
            raise ValueError("SomeModel does not support an attention implementation through AttentionInterface")
        return real(path, **kwargs)

    monkeypatch.setattr(hf_engine.AutoModelForCausalLM, "from_pretrained", refusing)
    with caplog.at_level("INFO", logger=hf_engine.__name__):
        model = hf_engine.load_model(ModelConfig(path=small_dir), torch.device("cpu"))
    assert calls == [ATTENTION, None]
    assert model.config._attn_implementation == "sdpa"
    assert "loading with the model's default attention" in caplog.text


def test_position_biases_are_refused_with_what_to_set():
    q, kv = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 3, 4)
    with pytest.raises(NotImplementedError, match="attn_implementation=sdpa"):
        sdpa_gqa(torch.nn.Module(), q, kv, kv, None, position_bias=torch.zeros(1, 2, 1, 3))
