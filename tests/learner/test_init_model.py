"""The locally built tiny model is a normal HF directory: Auto* classes load it, it generates."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.learner.init_model import PRESETS, build_model, build_tokenizer


def test_tokenizer_round_trips_text_and_has_specials(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["07+58=", "a b\n  c", "x = {1, 2}", "é ∑"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert len(tok("07+58=")["input_ids"]) == 6  # one token per ASCII character
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.decode([tok.eos_token_id]) == "<eos>"
    assert tok.padding_side == "left"


def test_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>1+2=<eos><|assistant|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_model_loads_and_generates(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == len(tok)
    batch = tok(["07+58=", "11+22="], return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(
        **batch, max_new_tokens=5, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=tok.pad_token_id
    )
    assert out.shape[0] == 2 and 6 < out.shape[1] <= 11
    assert torch.equal(out[:, :6], batch["input_ids"])


def test_presets_sizes_and_seed():
    tok = build_tokenizer()
    sizes = {name: sum(p.numel() for p in build_model(tok, name, 0, 64).parameters()) for name in ("tiny", "small")}
    assert sizes["tiny"] < 200_000 < 1_000_000 < sizes["small"] < 2_000_000
    a, b = build_model(tok, "tiny", 1, 64), build_model(tok, "tiny", 1, 64)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert set(PRESETS) >= {"tiny", "small"}
