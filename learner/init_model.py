"""Build small models locally (`fleetrl init-model`): no hub access is needed or used.

The result is a normal Hugging Face model directory: a byte-level tokenizer (one token per character for ASCII) (with pad, bos,
eos, unk, chat role markers and a chat template) and a Qwen2-architecture causal LM with random
initialisation, loadable with ``AutoTokenizer.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for bytes 0..255 (GPT-2's bytes_to_unicode order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


# hidden, layers, heads, kv heads, intermediate
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    ),
    # tiny's size with head_dim 32: vLLM's CPU attention kernels take head sizes 32, 64, 80, ... (not 16)
    "tiny32": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128
    ),
    "small": dict(
        hidden_size=192, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, intermediate_size=512
    ),
    "base": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408
    ),
    # Qwen2.5-0.5B's layer shapes (with this byte tokenizer's vocabulary): the GPU check's weight-update size
    "q05b": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
    ),
}


def build_tokenizer(max_length: int = 512) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer without merges: one token per byte, so per character for ASCII.

    It is the Qwen2 tokenizer's own format (``AutoTokenizer`` loads a qwen2 directory as
    ``Qwen2Tokenizer`` and rebuilds its byte-level pre-tokenizer), so it behaves identically after
    ``save_pretrained`` / ``from_pretrained`` and in any engine that serves Qwen2 models.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in byte_symbols():
        vocab[sym] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens=SPECIAL_TOKENS[4:],
        model_max_length=max_length,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tokenizer: Qwen2Tokenizer, preset: str, seed: int, max_positions: int) -> Qwen2ForCausalLM:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        **PRESETS[preset],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def init_model(out: str | Path, preset: str = "tiny", seed: int = 0, max_positions: int = 512) -> Path:
    """Write tokenizer + randomly initialised model to ``out``; returns the directory."""
    out = Path(out)
    tokenizer = build_tokenizer(max_positions)
    model = build_model(tokenizer, preset, seed, max_positions)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(args) -> int:
    out = init_model(args.out, args.preset, args.seed, args.max_positions)
    n = sum(p.numel() for p in Qwen2ForCausalLM.from_pretrained(out).parameters())
    print(f"wrote a {args.preset} Qwen2 model ({n / 1e6:.2f}M parameters) and its tokenizer to {out}")
    return 0
