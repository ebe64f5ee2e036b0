"""Generation engines on CPU: the `hf` engine on the tiny local model, the vLLM engine's pure helpers.

The behaviour log-probs are checked against what the learner computes: one teacher-forced forward
of the unpadded prompt + response, log_softmax(logits / T) at the sampled tokens.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.common.plugins.registry import RegistryError
from fleetrl.learner.init_model import init_model
from fleetrl.rollout.engines import ENGINES, Generation, SamplingParams, create_engine
from fleetrl.rollout.engines.hf import draw, filter_top_k_top_p

EOS = 2
PROMPTS = ["1+2=", "17+25=", "x", "what is 12*13? answer: "]  # ragged: 4, 6, 1 and 23 tokens


def make_engine(path: str, seed: int = 0):
    return create_engine("hf", ModelConfig(path=path), RolloutConfig(), "cpu", seed)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def new_model_dir(tmp_path_factory) -> str:
    """The tiny architecture with other random weights (seed 1)."""
    return str(init_model(tmp_path_factory.mktemp("models") / "tiny-seed1", preset="tiny", seed=1))


def teacher_forced_logp(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(z / T)[y] of each response token from one forward of the unpadded sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    scores = logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / (temperature or 1.0)
    return scores.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def one_sample(engine, prompt: list[int], **params) -> Generation:
    """One seeded sample of one prompt: a single row draws the same random numbers with or without
    stops, so a stopped sample is a prefix of the unstopped one."""
    [[sample]] = engine.generate_batch([prompt], SamplingParams(max_new_tokens=40, seed=11, **params), 1)
    return sample


def weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.model.state_dict().items()}


# ------------------------------------------------------------------------------- registry, API


def test_registry_and_unknown_name(tiny_model_dir):
    assert ENGINES.names() == ["hf", "vllm"]
    message = r"rollout.engine: unknown generation engine 'hff'.*'hf'.*valid names: hf, vllm"
    with pytest.raises(RegistryError, match=message):
        create_engine("hff", ModelConfig(path=tiny_model_dir), RolloutConfig(), "cpu", 0)


def test_package_imports_without_torch():
    probe = (
        "import sys, fleetrl.rollout.engines\nprint([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sampling_params_from_config_and_validation():
    cfg = RolloutConfig(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12, stop=["\n"], stop_token_ids=[9])
    assert SamplingParams.from_config(cfg) == SamplingParams(0.7, 0.9, 5, 12, ("\n",), (9,), None)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(max_new_tokens=0), dict(stop=("",))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---------------------------------------------------------------------------------- sampling


def test_top_k_top_p_filter_matches_loop():
    scores = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    for k, p in [(0, 0.5), (5, 1.0), (7, 0.8), (0, 1.0)]:
        fast = filter_top_k_top_p(scores, k, p)
        for row in range(scores.shape[0]):
            order = scores[row].argsort(descending=True).tolist()
            allowed = order[:k] if k else order
            probs = scores[row, allowed].softmax(-1).tolist()
            kept, mass = [], 0.0
            for token, prob in zip(allowed, probs):  # nucleus: add tokens until the mass reaches p
                if kept and mass >= p:
                    break
                kept.append(token)
                mass += prob
            assert set(torch.isfinite(fast[row]).nonzero().squeeze(1).tolist()) == set(kept)
            assert torch.equal(fast[row, kept], scores[row, kept])


def test_draw_follows_probabilities_and_skips_zero_mass():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(40_000, 1)
    counts = torch.bincount(draw(probs, torch.Generator().manual_seed(0)), minlength=4) / 40_000
    assert counts[1] == 0
    assert torch.allclose(counts, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.01)


# ---------------------------------------------------------------------------------- generate


def test_group_shapes(engine, prompt_ids):
    groups = engine.generate_batch(prompt_ids, SamplingParams(max_new_tokens=10, seed=1), n=3)
    assert len(groups) == len(prompt_ids) and all(len(group) == 3 for group in groups)
    for group in groups:
        for sample in group:
            assert 1 <= len(sample.token_ids) == len(sample.logprobs) <= 10
            assert sample.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in sample.logprobs)
    assert engine.generate_batch([], SamplingParams(), n=2) == []


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=16, seed=0),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=16, seed=1),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=16, seed=2),
        SamplingParams(temperature=0, max_new_tokens=16),
        SamplingParams(max_new_tokens=16, stop_token_ids=tuple(range(100, 160)), seed=3),
    ],
    ids=["t1", "t0.7-topk-topp", "t1.3-topp", "greedy", "early-stops"],  # early stops: rows leave the batch
)
def test_logprobs_match_teacher_forced_forward(engine, reference, prompt_ids, params):
    groups = engine.generate_batch(prompt_ids, params, n=4)
    for prompt, group in zip(prompt_ids, groups):
        for sample in group:
            expected = teacher_forced_logp(reference, prompt, sample.token_ids, params.temperature)
            assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-5, rtol=0), (prompt, sample)
            if params.top_k:  # sampled tokens lie in the top-k of their step (the filter did act)
                with torch.no_grad():
                    logits = reference(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1 : -1]
                rank = (logits > logits.gather(1, torch.tensor(sample.token_ids)[:, None])).sum(-1)
                assert (rank < params.top_k).all()


def test_max_new_tokens_gives_length(engine, prompt_ids):
    groups = engine.generate_batch(prompt_ids, SamplingParams(max_new_tokens=4, seed=3), n=4)
    samples = [s for group in groups for s in group]
    assert any(s.finish_reason == "length" for s in samples)
    for s in samples:
        assert len(s.token_ids) == 4 if s.finish_reason == "length" else s.token_ids[-1] == EOS


def test_context_length_ends_with_length(engine):
    prompt = [10 + i % 90 for i in range(510)]  # the tiny model's context is 512
    [[sample]] = engine.generate_batch([prompt], SamplingParams(max_new_tokens=8, seed=0), n=1)
    assert len(sample.token_ids) <= 2
    assert sample.finish_reason == ("length" if len(sample.token_ids) == 2 else "stop")


def test_eos_ends_response(engine, prompt_ids):
    groups = engine.generate_batch(prompt_ids, SamplingParams(max_new_tokens=48, seed=4), n=8)
    stopped = [s for group in groups for s in group if s.finish_reason == "stop"]
    assert stopped, "no sample ended with eos; pick another seed"
    for s in stopped:
        assert s.token_ids[-1] == EOS and EOS not in s.token_ids[:-1]
        assert "<eos>" not in s.text


def test_stop_token_id_ends_response(engine, prompt_ids):
    full = one_sample(engine, prompt_ids[1])
    stop_id = next(t for t in full.token_ids[5:] if t != EOS)
    end = full.token_ids.index(stop_id) + 1
    cut = one_sample(engine, prompt_ids[1], stop_token_ids=(stop_id,))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[:end] and cut.logprobs == full.logprobs[:end]
    assert cut.text == engine.tokenizer.decode(full.token_ids[: end - 1], skip_special_tokens=True)


def test_stop_string_cuts_text_and_tokens(engine, prompt_ids):
    decode = engine.tokenizer.decode
    full = one_sample(engine, prompt_ids[0])
    pairs = [decode(full.token_ids[i : i + 2]) for i in range(5, len(full.token_ids) - 1)]
    stop = next(text for text in pairs if len(text) == 2 and text.isascii() and text.isprintable())
    end = next(k for k in range(1, 41) if stop in decode(full.token_ids[:k], skip_special_tokens=True))
    assert end > 2, "the stop string should end mid-response"
    cut = one_sample(engine, prompt_ids[0], stop=("never-there", stop))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[:end]
    assert cut.text == full.text[: full.text.index(stop)] and stop not in cut.text


def test_seed_reproducibility(engine, prompt_ids):
    def tokens(seed):
        groups = engine.generate_batch(prompt_ids, SamplingParams(max_new_tokens=12, seed=seed), n=2)
        return [(s.token_ids, s.logprobs) for group in groups for s in group]

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)
    assert tokens(None) != tokens(None)  # the engine's own generator moves on between calls


def test_engine_seed_reproducibility(tiny_model_dir, prompt_ids):
    params = SamplingParams(max_new_tokens=12)
    runs = [make_engine(tiny_model_dir, seed=5).generate_batch(prompt_ids, params, n=2) for _ in range(2)]
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------------- weights


def test_param_specs_are_the_distinct_weights_in_state_dict_order(engine):
    state = engine.model.state_dict()
    specs = engine.param_specs()
    names = [name for name, _, _ in specs]
    assert names == [name for name in state if name != "lm_head.weight"]  # tied to the embedding
    assert all(shape == tuple(state[name].shape) and dtype == torch.float32 for name, shape, dtype in specs)


def test_update_weights_gives_the_new_models_outputs(tiny_model_dir, new_model_dir, prompt_ids):
    greedy_params = SamplingParams(temperature=0, max_new_tokens=16)
    expected = make_engine(new_model_dir).generate_batch(prompt_ids, greedy_params, n=1)
    engine = make_engine(tiny_model_dir)
    before = weights(engine)
    assert engine.generate_batch(prompt_ids, greedy_params, n=1) != expected
    new_state = AutoModelForCausalLM.from_pretrained(new_model_dir).state_dict()
    engine.update_weights(new_state.items())  # lm_head.weight (a tied alias) included
    assert engine.generate_batch(prompt_ids, greedy_params, n=1) == expected
    after = weights(engine)
    assert all(torch.equal(after[name], new_state[name]) for name in after)
    changed = [name for name in before if not torch.equal(before[name], new_state[name])]
    assert len(changed) > len(before) / 2  # the random weights differ (norms start at 1 in both)


def test_load_weights_from_dir_gives_the_new_models_outputs(tiny_model_dir, new_model_dir, prompt_ids):
    greedy_params = SamplingParams(temperature=0, max_new_tokens=16)
    expected = make_engine(new_model_dir).generate_batch(prompt_ids, greedy_params, n=1)
    engine = make_engine(tiny_model_dir)
    engine.load_weights_from_dir(new_model_dir)
    assert engine.generate_batch(prompt_ids, greedy_params, n=1) == expected


def test_bad_weights_are_rejected_without_any_change(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir)
    before = weights(engine)
    first = ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64))  # valid, listed first
    with pytest.raises(ValueError, match="unknown weight 'model.norm.weights'.*did you mean 'model.norm.weight'"):
        engine.update_weights([first, ("model.norm.weights", torch.zeros(64))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(65,\).*expects \(64,\)"):
        engine.update_weights(iter([first, ("model.norm.weight", torch.zeros(65))]))

    bad_shape, partial = tmp_path / "bad_shape", tmp_path / "partial"
    bad_shape.mkdir(), partial.mkdir()
    state = {name: t.clone() for name, t in before.items() if name != "lm_head.weight"}
    save_file({**state, "model.norm.weight": torch.zeros(65)}, str(bad_shape / "model.safetensors"))
    save_file({"model.norm.weight": torch.zeros(64)}, str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight' has shape"):
        engine.load_weights_from_dir(str(bad_shape))
    with pytest.raises(ValueError, match="weights are missing"):
        engine.load_weights_from_dir(str(partial))
    with pytest.raises(ValueError, match="does not exist"):
        engine.load_weights_from_dir(str(tmp_path / "nowhere"))
    after = weights(engine)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_bad_prompts_are_rejected(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate_batch([[5], []], SamplingParams(), n=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate_batch([[100_000]], SamplingParams(), n=1)
    with pytest.raises(ValueError, match="n=0"):
        engine.generate_batch([[5]], SamplingParams(), n=0)


# ------------------------------------------------------------------- vllm engine, without vllm


def test_vllm_logprobs_mode_choice():
    from fleetrl.rollout.engines.vllm import check_params_fit, logprobs_mode_for

    assert logprobs_mode_for(1.0, 50, 0.9) == "raw_logprobs"  # raw = log_softmax(z) = our T=1 value
    assert logprobs_mode_for(0.0, 0, 1.0) == "raw_logprobs"  # greedy: log-probs at T=1
    assert logprobs_mode_for(0.7, 0, 1.0) == "processed_logprobs"  # processed = log_softmax(z/T) here
    with pytest.raises(ValueError, match="rollout.temperature=0.7 with top_k=20"):
        logprobs_mode_for(0.7, 20, 1.0)
    check_params_fit(SamplingParams(temperature=0, top_k=3), "raw_logprobs")
    with pytest.raises(ValueError, match="temperature=0.5"):
        check_params_fit(SamplingParams(temperature=0.5), "raw_logprobs")
    with pytest.raises(ValueError, match="top_p=0.9"):
        check_params_fit(SamplingParams(temperature=0.5, top_p=0.9), "processed_logprobs")


def test_vllm_outputs_become_generations():
    from fleetrl.rollout.engines.vllm import span_versions, to_generation

    def completion(tokens, reason, text, spans=None):
        logprobs = [{tok: SimpleNamespace(logprob=-0.5 * tok), 99: SimpleNamespace(logprob=-9.0)} for tok in tokens]
        return SimpleNamespace(
            token_ids=tuple(tokens), logprobs=logprobs, finish_reason=reason, text=text, weight_versions=spans
        )

    span = lambda v, a, b: SimpleNamespace(version=v, start=a, end=b)  # noqa: E731
    out = to_generation(completion([3, 5, 6], "length", "abc", [span("2", 0, 1), span("3", 1, 3)]), "r1", 2)
    assert out == Generation([3, 5, 6], [-1.5, -2.5, -3.0], "length", "abc", versions=[2, 3, 3])
    assert out.request_id == "r1"
    assert to_generation(completion([4], "stop", "b"), "r2", 5).versions == [5]  # no spans: the engine's version
    assert span_versions([span("default", 0, 2)], 2, 0) == [0, 0]
    # submitted at version 2, queued across the update to 3: its prompt's KV may be version 2's (the prefix
    # cache is salted at submission), so the first token carries 2
    queued = to_generation(completion([3, 5], "stop", "ab", [span("3", 0, 2)]), "r4", 3, submitted=2)
    assert queued.versions == [2, 3]
    assert to_generation(completion([3, 5], "stop", "ab", [span("3", 0, 2)]), "r5", 3, submitted=3).versions == [3, 3]
    with pytest.raises(RuntimeError, match="abort"):
        to_generation(completion([3], "abort", ""), "r3", 0)


def test_vllm_specs_without_vllm(engine, tiny_model_dir):
    from fleetrl.rollout.engines.vllm import hf_state_specs

    specs, aliases = hf_state_specs(ModelConfig(path=tiny_model_dir), torch.bfloat16)
    assert [(n, s) for n, s, _ in specs] == [(n, s) for n, s, _ in engine.param_specs()]
    assert {d for _, _, d in specs} == {torch.bfloat16} and aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def test_vllm_engine_without_vllm_names_the_lane_that_installs_it(tiny_model_dir):
    pytest.importorskip("transformers")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here (the vLLM lane's environment)")
    with pytest.raises(ImportError, match=r"scripts/vllm_env.sh.*fleetrl\[gpu\]"):
        create_engine("vllm", ModelConfig(path=tiny_model_dir), RolloutConfig(), "cpu", 0)
