"""LoRA on the tiny model: adapters train alone, sync sends merged weights, exports and checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from fleetrl.common.config import ConfigError, load_config
from fleetrl.learner.lora import AdapterFreeReference, apply_lora, merged_params
from fleetrl.learner.runtime import init_distributed, iter_full_params, load_causal_lm
from fleetrl.learner.train import Learner
from tests.learner.conftest import inproc_client, synthetic_groups

LORA = ["model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}"]


def job(tiny_model_dir, tmp_path, *overrides):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "learner.groups_per_step=4",
            "learner.lr=1e-2",
            "sync.transport=filesystem",
            f"run.dir={tmp_path}",
            "learner.max_tokens_per_microbatch=40",
            "checkpoint.interval=0",
            "learner.device=cpu",
            *LORA,
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def dist():
    return init_distributed(load_config(None, ["learner.device=cpu"]))


def test_merged_params_use_the_base_model_names_and_add_the_delta(tiny_model_dir):
    cfg = job(tiny_model_dir, ".")
    plain = load_causal_lm(tiny_model_dir, cfg, torch.float32)
    names = [n for n, _ in iter_full_params(plain, 0)]
    peft_model = apply_lora(load_causal_lm(tiny_model_dir, cfg, torch.float32), cfg.model.lora)
    layer = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    merged = dict(merged_params(peft_model))
    assert list(merged) == names  # what a full fine-tune publishes, in the same order
    W = plain.model.layers[0].self_attn.q_proj.weight
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], W + (B @ A) * (8 / 4))  # alpha / r
    torch.testing.assert_close(
        merged["model.layers.0.self_attn.k_proj.weight"], plain.model.layers[0].self_attn.k_proj.weight
    )
    assert torch.equal(layer.base_layer.weight, W)  # never merged in place


def test_lora_trains_adapters_only_syncs_merged_weights_and_exports_a_plain_model(dist, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = job(tiny_model_dir, tmp_path, "algorithm.kl.placement=loss")
    client, _ = inproc_client(synthetic_groups(8))
    learner = Learner(cfg, tmp_path, client, dist)
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    in_optimizer = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    adapters = {n for n, p in learner.module.named_parameters() if "lora_" in n}
    assert {n for n, p in learner.module.named_parameters() if id(p) in in_optimizer} == adapters
    for _ in range(2):
        stats = learner.train_step()
    assert math.isfinite(stats["actor/loss"]) and stats["actor/kl"] > 0  # the reference: adapters switched off
    for name, p in learner.module.named_parameters():
        if name in adapters:
            assert not torch.equal(before[name], p), f"adapter {name} did not change"
        else:
            assert torch.equal(before[name], p), f"base weight {name} changed"

    published = load_file(str(tmp_path / "weights" / "v2" / "model.safetensors"))
    merged = {n: t.clone() for n, t in merged_params(learner.module)}
    assert list(published) == list(merged)
    for name, t in merged.items():
        torch.testing.assert_close(published[name], t)

    path = learner.save()
    module_state = torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    base_saved = {n for n in module_state if "lora_" not in n}
    assert len(module_state) > len(base_saved) and base_saved <= {"base_model.model.lm_head.weight"}  # adapters
    # (+ DeepSpeed keeps a tied weight it shares with the frozen embedding), not the base model
    assert (path / "hf" / "adapter" / "adapter_config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(path / "hf")  # plain transformers, no peft
    ids = torch.tensor([[10, 20, 30, 40, 50, 60]])
    learner.module.eval()
    exported.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, learner.module(input_ids=ids).logits, atol=1e-5, rtol=1e-4
        )
        adapted = learner.module(input_ids=ids).logits
    learner.close()

    again = Learner(cfg, tmp_path, client, dist)  # fresh base from model.path + the checkpoint's adapters
    again.resume(path)
    again.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(again.module(input_ids=ids).logits, adapted, atol=0, rtol=0)
    again.close()


def test_reference_is_the_model_with_adapters_off(tiny_model_dir):
    cfg = job(tiny_model_dir, ".")
    plain = load_causal_lm(tiny_model_dir, cfg, torch.float32)
    peft_model = apply_lora(load_causal_lm(tiny_model_dir, cfg, torch.float32), cfg.model.lora)
    for layer in peft_model.get_base_model().model.layers:
        torch.nn.init.normal_(layer.self_attn.q_proj.lora_B["default"].weight)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = AdapterFreeReference(peft_model)(input_ids=ids).logits
        assert torch.equal(ref, plain(input_ids=ids).logits)
        assert not torch.allclose(peft_model(input_ids=ids).logits, ref)  # and the adapters are back on after


def test_bad_lora_settings_are_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="zero_stage=2"):
        load_config(None, [*LORA, "learner.zero_stage=3"])
    cfg = load_config(None, ["model.lora={target_modules: [nope]}"])
    with pytest.raises(ValueError, match="q_proj"):  # names the layers the model has
        apply_lora(load_causal_lm(tiny_model_dir, cfg, torch.float32), cfg.model.lora)
