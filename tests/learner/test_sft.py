"""The warm start on tool conversations (`fleetrl sft` with rows that carry `messages`): the tokens are laid
out as an episode lays them out, only the assistant turns are trained, and a plain row is unchanged."""

from __future__ import annotations

from transformers import AutoTokenizer

from fleetrl.app.entries import evaluate_model
from fleetrl.common.chat.codec import ChatCodec
from fleetrl.common.data.tasks import calc_conversation
from fleetrl.learner.sft import collate, encode_pairs, sft


def test_conversation_rows_train_only_the_assistant_turns(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    conv = calc_conversation("37*48=", "1776")
    rows = [{"prompt": "37*48=", "answer": "1776", "messages": conv}, {"prompt": "07+58=", "answer": "65"}]
    (prompt, resp, mask), (p2, a2, m2) = encode_pairs(tok, rows)
    # the whole sequence is the chat template's rendering of the conversation, token for token
    whole = tok.apply_chat_template(conv, tokenize=False)
    assert tok.decode(prompt + resp) == whole[: len(tok.decode(prompt + resp))]
    assert prompt == ChatCodec(tok).initial(conv[:1])
    # trained: the two assistant turns (text + end of turn); not trained: the tool's answer between them
    trained = tok.decode([t for t, k in zip(resp, mask) if k])
    untrained = tok.decode([t for t, k in zip(resp, mask) if not k])
    assert 'calc("37*48")' in trained and trained.count("1776") == 1 and "1776" in untrained
    assert 0 in mask and mask[0] == 1 and mask[-1] == 1
    # a plain row: raw prompt, answer + eos, all trained
    assert p2 == tok("07+58=", add_special_tokens=False)["input_ids"] and a2[-1] == tok.eos_token_id and all(m2)
    ids, attn, labels = collate([(prompt, resp, mask), (p2, a2, m2)], tok.pad_token_id or 0)
    row = labels[0, len(prompt) : len(prompt) + len(resp)].tolist()
    assert row == [t if k else -100 for t, k in zip(resp, mask)]
    assert (labels[0, : len(prompt)] == -100).all() and int(attn[1].sum()) == len(p2) + len(a2)


def test_max_minutes_is_kept_between_evaluations(tiny_model_dir, arith_data, tmp_path):
    """The budget is checked every step, not only at evaluations (`--max-minutes 4` once ran 367 s)."""
    eval_data = arith_data.replace(".jsonl", ".eval.jsonl")
    result = sft(
        tiny_model_dir,
        arith_data,
        eval_data,
        str(tmp_path / "out"),
        target_acc=1.0,
        lr=1e-3,
        batch_size=8,
        max_steps=100_000,
        eval_every=1_000_000,
        eval_n=10,
        seed=0,
        max_minutes=0.05,
        evaluate_model=evaluate_model,
    )
    assert 0 < result["steps"] < 100_000  # before: no evaluation, so no look at the clock, until max_steps
    assert (tmp_path / "out" / "model.safetensors").exists()
