"""LoRA in the learner (``model.lora``): peft adapters train, everything else sees a plain model.

    policy = apply_lora(load_causal_lm(...), cfg.model.lora)   # only adapter weights require grad
    merged_params(policy)          # (original HF name, W + B A * scaling) for weight sync and export
    lora_param_specs(policy)       # the publisher's specs under the same original names
    export_merged(policy, out, ...)  # out/ = merged save_pretrained model, out/adapter/ = the adapter
    AdapterFreeReference(policy)   # the frozen reference: the same model with adapters switched off

Only the learner knows about LoRA. Rollout engines receive merged weights under the names the base
model has (what ``iter_full_params`` yields for a full fine-tune), so they need no LoRA support. The
merge is computed functionally — W + get_delta_weight(adapter) per layer, one layer at a time — and
never merges into the module in place, so the trained base weights stay bit-identical.

Checkpoints keep the adapters and their optimizer state only (DeepSpeed's
``exclude_frozen_parameters``); the base comes from ``model.path`` again on resume. ZeRO-3 is refused
at config time: the adapters are small, ZeRO-2 already shards their optimizer state, and merging
partitioned base weights would need a gather per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from fleetrl.common.config.schema import LoraConfig
from fleetrl.learner.checkpoint import export_hf

ADAPTER = "default"  # peft's adapter name; the learner trains exactly one


def apply_lora(model: torch.nn.Module, lora: LoraConfig, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters on ``lora.target_modules``; base weights are frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if gradient_checkpointing:  # reentrant checkpointing needs an input that requires grad
        model.enable_input_require_grads()
    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(
            f"model.lora.target_modules={list(lora.target_modules)} matches no layer of "
            f"{type(model).__name__} ({e}); its linear layers are named {names}"
        ) from None


def _layout(peft_model) -> list[tuple[str, torch.nn.Parameter, object | None]]:
    """(original name, base parameter, LoRA layer whose delta to add or None) in named_parameters order."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    out = []
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue  # lora_A / lora_B (and embedding variants): the delta, not a base weight
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner.removesuffix(".base_layer") in layers:
            module = owner.removesuffix(".base_layer")
            out.append((f"{module}.{leaf}", p, layers[module] if leaf == "weight" else None))
        else:
            out.append((name, p, None))
    return out


@torch.no_grad()
def merged_params(peft_model) -> Iterator[tuple[str, torch.Tensor]]:
    """(original HF name, merged tensor) per base parameter: W + B A * scaling where a LoRA layer sits.

    A fresh tensor per adapted weight (one layer at a time, in W's dtype); other weights are yielded
    as they are (detached, not copied).
    """
    for name, p, layer in _layout(peft_model):
        if layer is None:
            yield name, p.detach()
        else:
            yield name, p.detach() + layer.get_delta_weight(ADAPTER).to(p.dtype)


def lora_param_specs(peft_model):
    """The publisher's (name, shape, dtype) list: the base model's names, as ``merged_params`` yields them."""
    from fleetrl.common.messages import ParamSpec

    return [
        ParamSpec(name=n, shape=list(p.shape), dtype=str(p.dtype).removeprefix("torch."))
        for n, p, _ in _layout(peft_model)
    ]


def adapter_params(peft_model) -> dict[str, torch.Tensor]:
    """The trainable adapter tensors by name (what the optimizer holds)."""
    return {n: p for n, p in peft_model.named_parameters() if p.requires_grad}


def export_merged(peft_model, out: Path, tokenizer_dir: str, rank: int) -> None:
    """``out/``: the merged model (plain ``from_pretrained`` loads it) + tokenizer; ``out/adapter/``: the adapter."""
    export_hf(peft_model.get_base_model(), merged_params(peft_model), out, tokenizer_dir, rank)
    if rank == 0:
        peft_model.save_pretrained(Path(out) / "adapter", safe_serialization=True)


class AdapterFreeReference:
    """The frozen reference model under LoRA, for free: the policy with its adapters switched off.

    The base weights never train, so this is exactly the initial model, without a second copy in
    memory. Call it under ``torch.no_grad()`` (the learner's reference passes do).
    """

    def __init__(self, peft_model):
        self.model = peft_model

    def __call__(self, **kwargs):
        with self.model.disable_adapter():
            return self.model(**kwargs)
