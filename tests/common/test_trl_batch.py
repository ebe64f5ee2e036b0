"""TRL's batch sizes, counted in completions, read as fleetrl's groups (issue 30, item 10).

TRL's GRPO: per_device_train_batch_size x num_processes x gradient_accumulation_steps completions make one
optimizer step; generation_batch_size completions are generated per round (by default one optimizer step's
worth), split into generation_batch_size / that optimizer steps. fleetrl: one learner step leases
learner.groups_per_step groups of rollout.group_size and makes learner.mini_batches optimizer steps.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetrl.common.config import ConfigError, load_config


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fleetrl.config"]


def test_per_device_batch_counts_every_rank_and_becomes_groups(caplog):
    # 8 completions per device x 2 ranks x 1 accumulation = 16 completions per optimizer step = 4 groups of 4
    cfg = load_config(None, ["num_generations=4", "learner.num_ranks=2", "per_device_train_batch_size=8"])
    same = load_config(
        None, ["rollout.group_size=4", "learner.num_ranks=2", "learner.groups_per_step=4", "learner.mini_batches=1"]
    )
    assert cfg == same
    said = [n for n in notes(caplog) if "per_device_train_batch_size" in n]
    assert len(said) == 1
    assert (
        "per_device_train_batch_size=8 x gradient_accumulation_steps=1 = 8 completions per rank and optimizer "
        "step, x learner.num_ranks=2 = 16 per optimizer step"
    ) in said[0]
    assert "read as learner.groups_per_step=4, learner.mini_batches=1" in said[0]


def test_a_generation_batch_of_several_optimizer_steps_becomes_mini_batches(tmp_path):
    # TRL: 4 x 1 rank x 2 accumulation = 8 completions per optimizer step; 32 generated per round = 4 steps of 8
    job = tmp_path / "job.yaml"
    job.write_text(
        "num_generations: 4\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n"
        "generation_batch_size: 32\n"
    )
    cfg = load_config(job)
    assert (cfg.learner.groups_per_step, cfg.learner.mini_batches, cfg.rollout.group_size) == (8, 4, 4)


def test_a_generation_batch_alone_sets_only_the_groups():
    cfg = load_config(None, ["generation_batch_size=64"])  # rollout.group_size's default 8: 8 groups
    assert (cfg.learner.groups_per_step, cfg.learner.mini_batches) == (8, 1)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (
            ["num_generations=4", "per_device_train_batch_size=3"],
            "per_device_train_batch_size=3 x gradient_accumulation_steps=1 = 3 completions per rank and optimizer step is "
            "not a whole number of groups of rollout.group_size=4 (a group is trained on one rank); make it a multiple of 4",
        ),
        (
            ["num_generations=4", "generation_batch_size=30"],
            "generation_batch_size=30 is not a whole number of groups per learner rank (rollout.group_size=4 x "
            "learner.num_ranks=1); make it a multiple of 4",
        ),
        (
            ["num_generations=4", "learner.num_ranks=4", "generation_batch_size=8"],  # 2 groups for 4 ranks
            "make it a multiple of 16",
        ),
        (
            ["num_generations=4", "per_device_train_batch_size=8", "learner.num_ranks=2", "generation_batch_size=24"],
            "generation_batch_size=24 is not a whole number of optimizer steps of 16 completions (per_device_train_batch_size"
            "=8 x gradient_accumulation_steps=1 = 8 completions per rank and optimizer step, x learner.num_ranks=2); make it "
            "a multiple of 16",
        ),
        (
            ["per_device_train_batch_size=8", "learner.groups_per_step=2"],
            "per_device_train_batch_size (TRL's batch sizes, in completions) and learner.groups_per_step are both set; "
            "keep one",
        ),
        (["per_device_train_batch_size=8", "learner.mini_batches=2"], "and learner.mini_batches are both set"),
        (["gradient_accumulation_steps=4"], "gradient_accumulation_steps counts with per_device_train_batch_size only"),
        (["per_device_train_batch_size=0"], "per_device_train_batch_size=0: give a whole number >= 1"),
        (
            ["per_device_train_batch_size=8", "algorithm.type=dpo"],
            "a DPO step counts pairs: set learner.groups_per_step",
        ),
    ],
)
def test_sizes_that_do_not_divide_or_clash_are_refused_naming_the_fix(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert says in str(e.value)


def test_config_validate_prints_each_note_once_with_its_name(tmp_path, tiny_model_dir, arith_data):
    job = tmp_path / "job.yaml"
    job.write_text(
        f"model: {{path: {tiny_model_dir}}}\ndata: {{train: {arith_data}}}\nrollout: {{rewards: [{{name: "
        "exact}]}\nnum_generations: 4\ngeneration_batch_size: 32\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", "config", "validate", "--config", str(job)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    notes = [line for line in out.stderr.splitlines() if line.startswith("fleetrl config: note: ")]
    assert len(notes) == 2 and "num_generations=4 is read as rollout.group_size=4" in notes[0], out.stderr
    assert "generation_batch_size (TRL's, in completions) read as learner.groups_per_step=8" in notes[1]
    assert "config: num_generations" not in out.stderr.replace("fleetrl config: note: num_generations", "")
