"""Config: YAML + overrides round trip, typed overrides, and errors that name the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.common.config import (
    ConfigError,
    JobConfig,
    config_docs,
    dump_yaml,
    load_config,
    parse_value,
    save_resolved,
)

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local path of the defaults exists here, so none is made absolute
    cfg = load_config()
    path = save_resolved(cfg, tmp_path)
    assert path == tmp_path / "config.yaml"
    assert load_config(path) == cfg


def test_a_saved_config_keeps_its_local_paths_from_any_directory(tmp_path, monkeypatch):
    """`fleetrl run --resume RUN_DIR` from another directory: the saved paths must not be relative to the first."""
    project = tmp_path / "project"
    (project / "models" / "m").mkdir(parents=True)
    (project / "data").mkdir()
    (project / "data" / "t.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (project / "rw.py").write_text("def r(completion, **kw):\n    return 1.0\n")
    monkeypatch.chdir(project)
    cfg = load_config(
        None,
        [
            "model.path=models/m",
            "data.train=data/t.jsonl",
            "data.eval=openai/gsm8k",
            "rollout.rewards=[{name: python, args: {function: 'rw.py:r'}}, {name: exact}]",
        ],
    )
    saved = save_resolved(cfg, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    again = load_config(saved)
    assert again.model.path == str(project / "models" / "m") and again.data.train == str(project / "data" / "t.jsonl")
    assert again.rollout.rewards[0].args["function"] == f"{project / 'rw.py'}:r"
    assert again.data.eval == "openai/gsm8k"  # a dataset name, not a local path: kept as written


def test_yaml_then_overrides_round_trip(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text('learner:\n  lr: 1e-5\n  total_steps: 7\nrollout:\n  stop: ["\\n"]\n')
    cfg = load_config(f, ["learner.lr=3e-4", "rollout.group_size=4", "broker.spool_dir=/tmp/spool"])
    assert cfg.learner.lr == pytest.approx(3e-4)  # override beats the file
    assert cfg.learner.total_steps == 7  # file beats the default
    assert cfg.rollout.stop == ["\n"]
    again = tmp_path / "again.yaml"
    again.write_text(dump_yaml(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3", 3),
        ("1e-3", 1e-3),
        ("-2.5E2", -250.0),
        ("true", True),
        ("null", None),
        ("[a, 1]", ["a", 1]),
        ("{name: exact}", {"name": "exact"}),
        ("hello", "hello"),
        (".5", 0.5),
    ],
)
def test_override_values_are_typed(text, expected):
    assert parse_value(text) == expected


def test_override_into_optional_section_and_list_item(tmp_path):
    cfg = load_config(None, ["model.lora.r=16", "health.max_rollbacks=0"])
    assert cfg.model.lora is not None and cfg.model.lora.r == 16 and cfg.model.lora.alpha == 16.0
    f = tmp_path / "job.yaml"
    f.write_text("rollout:\n  rewards:\n    - name: exact\n    - name: length\n      weight: 0.1\n")
    cfg = load_config(f, ["rollout.rewards.1.weight=0.5"])
    assert [(r.name, r.weight) for r in cfg.rollout.rewards] == [("exact", 1.0), ("length", 0.5)]


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["learner.lrr=1"], ["learner.lrr", "unknown key", "did you mean `learner.lr`"]),
        (["lerner.lr=1"], ["lerner", "did you mean `learner`"]),
        (
            ["rollout.rewards=[{name: exact, wieght: 2}]"],
            ["rollout.rewards.0.wieght", "did you mean `rollout.rewards.0.weight`"],
        ),
        (["learner.lr=abc"], ["learner.lr", "'abc'", "expected `float`"]),
        (["learner.lr=-1"], ["learner.lr", "-1", "> 0.0"]),
        (["learner.zero_stage=4"], ["learner.zero_stage", "4", "<= 3"]),
        (["rollout.engine=hff"], ["rollout.engine", "'hff'", "valid values: hf, vllm", "did you mean 'hf'"]),
        (["learner=5"], ["learner", "is a section"]),
        (["learner.lr"], ["not of the form section.key=value"]),
        (["rollout.rewards.0.weight=2"], ["rollout.rewards.0", "override the whole list"]),
        (["algorithm.dual_clip=0.5"], ["algorithm.dual_clip must be > 1", "0.5"]),
        (["algorithm.off_policy.mode=none"], ["broker.max_staleness=2", "algorithm.off_policy.mode=tis"]),
    ],
)
def test_bad_config_errors_name_key_value_and_fix(overrides, fragments):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))


def test_every_unknown_key_is_reported_and_a_key_of_another_section_is_named():
    with pytest.raises(ConfigError) as e:
        load_config(
            None, ["lr=1e-4", "learner.lrr=1", "learner.temperature=2", "rollout.rewards=[{name: exact, wieght: 2}]"]
        )
    lines = str(e.value).splitlines()
    assert lines[0] == "4 unknown keys:" and len(lines) == 5, lines
    assert lines[1].startswith("  lr: unknown key; did you mean `learner.lr`")  # the schema's key of that name
    assert "learner.lrr: unknown key; did you mean `learner.lr`?" in lines[2]
    assert "learner.temperature: unknown key; did you mean `rollout.temperature`?" in lines[3]
    assert "rollout.rewards.0.wieght: unknown key; did you mean `rollout.rewards.0.weight`?" in lines[4]


def test_the_cli_prints_one_line_per_unknown_key():
    out = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "config", "validate", "lr=1e-4", "learner.lrr=1"],
        capture_output=True,
        text=True,
    )
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 3, out.stderr
    assert lines[0] == "fleetrl config: config error: 2 unknown keys:"
    assert lines[1].startswith("  lr: unknown key; did you mean `learner.lr`") and lines[2].startswith("  learner.lrr:")


def test_trl_and_verl_names_are_read_with_a_note(caplog):
    cfg = load_config(
        None,
        ["num_generations=4", "max_completion_length=16", "learning_rate=1e-5", "beta=0.04", "max_prompt_length=64"],
    )
    assert (cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.learner.lr, cfg.data.max_prompt_tokens) == (
        4,
        16,
        1e-5,
        64,
    )
    assert cfg.algorithm.kl.coef == 0.04 and cfg.algorithm.kl.placement == "loss"  # TRL's beta is a KL loss term
    notes = [r.getMessage() for r in caplog.records if r.name == "fleetrl.config"]
    assert len(notes) == 5 and "num_generations=4 is read as rollout.group_size=4" in notes[0]
    assert load_config(None, ["beta=0.2", "algorithm.type=dpo"]).algorithm.beta == 0.2
    assert load_config(None, ["beta=0"]).algorithm.kl.placement == "none"  # TRL's default: no KL
    with pytest.raises(ConfigError, match="num_generations .* and rollout.group_size are both set; keep one"):
        load_config(None, ["num_generations=4", "rollout.group_size=8"])


def test_synchronous_job_without_correction_is_allowed():
    cfg = load_config(None, ["algorithm.off_policy.mode=none", "broker.max_staleness=0"])
    assert cfg.broker.max_staleness == 0


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)


def test_required_field_of_list_item_is_reported():
    with pytest.raises(ConfigError, match=r"rollout.rewards.0: object missing required field `name`"):
        load_config(None, ["rollout.rewards=[{weight: 2}]"])


def test_every_field_is_documented():
    docs = config_docs()
    rows = [line for line in docs.splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    for row in rows:
        description = row.rstrip(" |").split(" | ")[-1]
        assert len(description) > 10, row


def test_docs_config_md_is_generated_from_the_structs():
    assert (ROOT / "docs" / "config.md").read_text() == config_docs(), "run `make docs` to regenerate docs/config.md"


def test_shipped_configs_are_valid():
    configs = sorted((ROOT / "configs").rglob("*.yaml"))
    for path in configs:
        assert isinstance(load_config(path), JobConfig), path


def test_config_show_cli_prints_resolved_yaml(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "config", "show", "learner.lr=2e-4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "lr: 0.0002" in out
    bad = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "config", "validate", "learner.lrr=1"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "did you mean `learner.lr`" in bad.stderr
