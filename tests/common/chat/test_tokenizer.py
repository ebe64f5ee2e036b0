"""One tokenizer loader (common/chat/tokenizer.py): it honours model.trust_remote_code, and nothing else loads one."""

from __future__ import annotations

import ast
from pathlib import Path

import transformers

from fleetrl.common.chat.tokenizer import job_tokenizer, load_tokenizer
from fleetrl.common.config.schema import ModelConfig

ROOT = Path(__file__).resolve().parents[3]


def test_the_job_tokenizer_is_model_tokenizer_else_model_path_with_trust_remote_code(monkeypatch):
    calls = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append((path, kw)) or "tok"
    )
    assert job_tokenizer(ModelConfig(path="m", trust_remote_code=True)) == "tok"
    assert job_tokenizer(ModelConfig(path="m", tokenizer="t")) == "tok"
    assert load_tokenizer("d") == "tok"
    assert calls == [
        ("m", {"trust_remote_code": True}),
        ("t", {"trust_remote_code": False}),
        ("d", {"trust_remote_code": False}),
    ]


def test_a_real_tokenizer_loads(tiny_model_dir):
    tok = job_tokenizer(ModelConfig(path=tiny_model_dir))
    assert tok("12+3=", add_special_tokens=False)["input_ids"]


def test_no_other_module_loads_a_tokenizer_itself():
    """Six places loaded one (two ignoring trust_remote_code) before issue 25; now only the loader does."""
    found = []
    for top in ("common", "broker", "rollout", "learner", "app"):
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "common" / "chat" / "tokenizer.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "from_pretrained"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "AutoTokenizer"
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
