"""ChatCodec.encode calls the fast tokenizer's backend directly (issue 28: CPU per endpoint call): the ids
must be exactly what ``tokenizer(text, add_special_tokens=False)`` gives, and it must fall back to that
call whenever the backend would tokenize differently (truncation or padding left set on it, special
tokens split)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fleetrl.common.chat.codec import ChatCodec, decode

TEXTS = [
    "12*34=",
    "<|im_start|>tool\n<tool_response>\n2414\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>',
    "  leading spaces, trailing\n\n",
    "unicode: é ü 数学 🙂 \u200b",
    "<|im_end|><|im_end|>x<|endoftext|>",
    "a" * 3000,
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def wrapper_ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_encode_gives_the_tokenizers_ids(tok):
    codec = ChatCodec(tok)
    assert codec._backend is not None  # the fast path is what this test checks
    for text in TEXTS:
        assert codec.encode(text) == wrapper_ids(tok, text), text
    assert codec.encode("") == []
    # a whole rendered conversation, as the endpoint and the tool env tokenize it
    msgs = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": "408 <|im_end|> ok"}]
    text = codec.render(msgs, False)
    assert codec.encode(text) == wrapper_ids(tok, text)


def test_encode_falls_back_when_the_backend_would_differ(tok):
    codec = ChatCodec(tok)
    text = "x" * 50
    backend = tok.backend_tokenizer
    backend.enable_truncation(max_length=8)  # left set by someone's tokenizer(..., truncation=True)
    try:
        assert len(backend.encode(text, add_special_tokens=False).ids) == 8
        assert codec.encode(text) == wrapper_ids(tok, text)  # the wrapper resets truncation: all the ids
        assert len(codec.encode(text)) > 8
    finally:
        backend.no_truncation()
    before = tok.split_special_tokens
    tok.split_special_tokens = True
    try:
        assert codec._backend is None
        assert codec.encode("<|im_end|>") == wrapper_ids(tok, "<|im_end|>")
    finally:
        tok.split_special_tokens = before


def test_decode_gives_the_tokenizers_text(tok):
    ids_of = [wrapper_ids(tok, text) for text in TEXTS] + [[], [0, 1, 2], list(range(40))]
    for ids in ids_of:
        for skip in (False, True):
            assert decode(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    before = tok.clean_up_tokenization_spaces
    tok.clean_up_tokenization_spaces = True  # the wrapper would post-process: decode goes through it
    try:
        ids = wrapper_ids(tok, "a , b .")
        assert decode(tok, ids) == tok.decode(ids)
    finally:
        tok.clean_up_tokenization_spaces = before
