"""Mistakes named before anything starts: `fleetrl config validate` and `fleetrl run` check what the config
names (app/checks.py), one line per problem naming the key, no traceback, no run directory."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from fleetrl.app.checks import check_job
from fleetrl.common.config import load_config

CLI = [sys.executable, "-m", "fleetrl.app.cli"]


@pytest.fixture
def job(tmp_path, tiny_model_dir, arith_data):
    path = tmp_path / "job.yaml"
    path.write_text(
        f"model: {{path: {tiny_model_dir}}}\ndata: {{train: {arith_data}}}\nrollout: {{rewards: [{{name: exact}}]}}\n"
    )
    return path


def problems(job, *overrides: str) -> list[str]:
    return check_job(load_config(job, list(overrides)))


def test_a_good_job_has_no_problems(job):
    assert problems(job) == []


def test_model_directory_mistakes_name_the_key_and_the_fix(job, tmp_path, tiny_model_dir):
    [hub] = problems(job, "model.path=Qwen/Qwen2.5-0.5B")
    assert hub.startswith("model.path='Qwen/Qwen2.5-0.5B' does not exist") and "`hf download Qwen/Qwen2.5-0.5B" in hub
    assert "offline" in hub and "set model.path=models/qwen2.5-0.5b" in hub
    assert "huggingface-cli" not in hub  # huggingface_hub ships only `hf` now
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    [no_config] = problems(job, f"model.path={empty}")
    assert "no config.json" in no_config and "model.path" in no_config
    no_template = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, no_template)
    (no_template / "chat_template.jinja").unlink()
    assert problems(job, f"model.path={no_template}") == []  # not asked for
    [template] = problems(job, f"model.path={no_template}", "data.apply_chat_template=true")
    assert template.startswith("data.apply_chat_template is true") and "no chat template" in template


def test_data_mistakes_name_the_key(job, tmp_path):
    [missing] = problems(job, "data.train=data/none.jsonl")
    assert (
        missing == "data.train='data/none.jsonl' does not exist; create it (e.g. `fleetrl init-data`) or fix the path"
    )
    [column] = problems(job, "data.prompt_key=question")
    assert column.startswith("data.prompt_key='question' is not a column of data.train") and "prompt" in column
    [answer] = problems(job, "data.answer_key=reward_model.ground_truth")  # the exact reward needs answers
    assert answer.startswith("data.answer_key='reward_model.ground_truth' is not a column")
    [name] = problems(job, "data.train=openai/gsm8k-not-cached")
    assert "neither a local file or directory nor a dataset in the local HF cache" in name and "save_to_disk" in name
    [hook] = problems(job, "data.map=nowhere.mod:fn")
    assert hook.startswith("data.map: cannot import 'nowhere.mod'")
    [interval] = problems(job, "run.eval_interval=10")
    assert interval.startswith("run.eval_interval=10 evaluates on data.eval, which is not set")


def test_reward_mistakes_name_the_entry(job, arith_data):
    [fn] = problems(job, "rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:nope'}}]")
    assert fn.startswith("rollout.rewards[0].args: module 'tests.rollout.user_rewards' has no attribute 'nope'")
    [sig] = problems(
        job,
        "rollout.rewards=[{name: exact}, {name: python, args: {function: 'tests.rollout.user_rewards:needs_unknown'}}]",
    )
    assert sig.startswith("rollout.rewards[1].args:") and "reference" in sig
    [model] = problems(job, "rollout.rewards=[{name: model, args: {path: /no/such/rm}}]")
    assert model.startswith("rollout.rewards[0].args: path '/no/such/rm' is not a model directory")
    shaped = [
        "rollout.rewards=[{name: exact}, {name: length, args: {target: 4}}]",
        f"data.eval={arith_data}",
        "run.eval_interval=5",
    ]
    [success] = problems(job, *shaped)
    assert success.startswith("run.eval_success:")
    assert problems(job, *shaped, "run.eval_success=1.0") == []


def test_a_typo_in_a_plugin_name_is_refused_when_the_config_decodes(job):
    result = subprocess.run(
        [*CLI, "config", "validate", "-c", str(job), "rollout.rewards=[{name: maht}]"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "did you mean 'math'" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_config_validate_takes_the_config_and_overrides_in_any_order(job):
    ok = subprocess.run([*CLI, "config", "validate", "-c", str(job), "learner.lr=1e-4"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == f"{job}: OK", ok.stderr
    bad = subprocess.run(
        [*CLI, "config", "validate", "learner.lr=1e-4", "-c", str(job), "model.path=/no/model"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "fleetrl config: model.path='/no/model' does not exist; fleetrl loads models from local directories only "
        "(jobs run offline, HF_HUB_OFFLINE=1): fix the path or create a model there (`fleetrl init-model --out "
        "/no/model`)"
    ]


def test_debug_shows_the_traceback(job):
    quiet = subprocess.run([*CLI, "config", "show", "-c", str(job), "learner.lrr=1"], capture_output=True, text=True)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    loud = subprocess.run(
        [*CLI, "--debug", "config", "show", "-c", str(job), "learner.lrr=1"], capture_output=True, text=True
    )
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "ConfigError" in loud.stderr


def test_run_refuses_a_broken_job_before_making_a_run_directory(job, tmp_path):
    root = tmp_path / "runs"
    result = subprocess.run(
        [*CLI, "run", "-c", str(job), f"run.root={root}", "model.path=Qwen/Qwen2.5-0.5B", "data.train=missing.jsonl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert [line.split(":")[1].strip().split("=")[0] for line in lines] == ["model.path", "data.train"]
    assert not root.exists(), "a job that cannot start made a run directory"
    resume = subprocess.run([*CLI, "run", "--resume", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert resume.returncode == 2 and "no config.yaml there" in resume.stderr


def test_a_trl_reward_needing_a_column_the_data_lacks_is_refused(job):
    trl = "rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:reward_func'}}]"
    [problem] = problems(job, trl)
    assert problem.startswith(
        "rollout.rewards[0]: tests.rollout.user_rewards:reward_func needs the data column(s) ['ground_truth']"
    )
    assert "'answer'" in problem  # the list names the columns the rows do have (it used to show [])
    per_sample = "rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:contains_answer'}}]"
    assert problems(job, per_sample) == []  # a per-sample function takes fields, not columns


def test_chat_prompts_need_a_tokenizer_with_a_chat_template(tmp_path, tiny_model_dir):
    import json

    bare = tmp_path / "bare-model"
    shutil.copytree(tiny_model_dir, bare)
    for f in bare.glob("chat_template*"):
        f.unlink()
    conf = bare / "tokenizer_config.json"
    conf.write_text(json.dumps({k: v for k, v in json.loads(conf.read_text()).items() if k != "chat_template"}))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}) + "\n")
    job = tmp_path / "chat.yaml"
    job.write_text(
        f"model: {{path: {bare}}}\ndata: {{train: {data}, apply_chat_template: false}}\n"
        "rollout: {rewards: [{name: exact}]}\n"
    )
    found = [p for p in problems(job) if "chat messages" in p]
    assert len(found) == 1 and "has no chat template" in found[0] and str(bare) in found[0]
    with_template = tmp_path / "chat2.yaml"  # fleetrl init-model's tokenizers carry a chat template
    with_template.write_text(job.read_text().replace(str(bare), str(tiny_model_dir)))
    assert not [p for p in problems(with_template) if "chat messages" in p]


def test_a_typo_in_a_local_path_is_not_offered_a_hub_download(job, tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    [typo] = problems(job, "model.path=models/nope")
    assert "does not exist" in typo and "hub id" not in typo and "hf download" not in typo


def test_the_dataset_hint_names_the_configuration(job):
    found = [p for p in problems(job, "data.train=openai/gsm8k-not-cached") if p.startswith("data.train=")]
    assert found and "load_dataset('openai/gsm8k-not-cached', 'CONFIG')" in found[0] and "'main'" in found[0]
    with_subset = [
        p
        for p in problems(job, "data.train=openai/gsm8k-not-cached", "data.subset=main")
        if p.startswith("data.train=")
    ]
    assert "load_dataset('openai/gsm8k-not-cached', 'main')" in with_subset[0]


def test_tool_functions_and_environment_classes_are_checked_up_front(job):
    tool = "rollout.env.type=tool"
    found = problems(
        job,
        tool,
        "rollout.env.tool.tools=[fleetrl.rollout.envs.tools:calc, nowhere.mod:fn, "
        "fleetrl.rollout.envs.tools:calc, tests.rollout.envs.envs_for_tests:NoClass]",
    )
    assert [p.split(":")[0] for p in found] == ["rollout.env.tool.tools[1]", "rollout.env.tool.tools[2]"], found
    assert "nowhere.mod" in found[0] and "same name as another tool ('calc')" in found[1]
    assert problems(job, tool, "rollout.env.tool.tools=[fleetrl.rollout.envs.tools:calc]") == []
    user = ["rollout.env.type=user", "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:Chatter"]
    assert problems(job, *user) == []
    [bad_args] = problems(job, *user, "rollout.env.user.args={nope: 1}")
    assert bad_args.startswith("rollout.env.user.args:") and "nope" in bad_args
    [not_a_class] = problems(
        job, "rollout.env.type=user", "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:NoClass"
    )
    assert not_a_class.startswith("rollout.env.user.cls:") and "reset(row) and step(message)" in not_a_class


def test_validate_names_the_defaults_a_job_relies_on(tmp_path, tiny_model_dir, arith_data):
    bare = tmp_path / "bare.yaml"
    bare.write_text(f"data: {{train: {arith_data}}}\n")
    out = subprocess.run(
        [*CLI, "config", "validate", "-c", str(bare), f"model.path={tiny_model_dir}"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == f"{bare}: OK", out.stderr
    assert out.stderr.splitlines() == [
        "fleetrl config: note: rollout.rewards is not set, so the default ['math'] is "
        "used; set it in the job file to drop this note"
    ]
