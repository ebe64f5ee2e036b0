"""completions.jsonl shows a multi-turn sample's role markers (issue 28: they were stripped, so the turns
ran together); a single-turn response still reads as plain text."""

from __future__ import annotations

from fleetrl.common.config import load_config
from fleetrl.common.messages import build_group
from fleetrl.learner.completions import CompletionLog


def test_multi_turn_rows_keep_role_markers(tiny_model_dir):
    log = CompletionLog(load_config(None, [f"model.path={tiny_model_dir}", "telemetry.log_completions_prompts=2"]))
    tok = log.tokenizer
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = enc("<|user|>Guess.<eos><|assistant|>")
    first, obs, second = enc("5<eos>"), enc("<|user|>Too low.<eos><|assistant|>"), enc("7<eos>")
    multi = build_group(
        "g1",
        "p",
        0,
        prompt,
        [(first + obs + second, [-0.1] * len(first + obs + second))],
        [1.0],
        loss_masks=[[1] * len(first) + [0] * len(obs) + [1] * len(second)],
    )
    single = build_group("g2", "p", 0, prompt, [(first, [-0.1] * len(first))], [0.0])
    rows = log.rows(3, [multi, single], None)
    assert "<|user|>Too low." in rows[0]["response"] and rows[0]["response"].count("<|assistant|>") == 1
    assert rows[1]["response"] == tok.decode(first, skip_special_tokens=True) and "<eos>" not in rows[1]["response"]
