"""The shared prompt of a group never cuts a sample's prompt to fit (issue 28): sessions opened with and
without a system message used to be trained under the first one's first token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleetrl.rollout import group_rule as groups
from fleetrl.rollout.envs.base import EnvStats, Episode

SYS, USER, ASSIST = 1, 2, 3  # stand-ins for <|system|>, <|user|>, <|assistant|>


def episode(prompt):
    return Episode(
        token_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
        text="",
        prompt_ids=list(prompt),
        loss_mask=[1, 1],
        versions=[0, 0],
    )


def test_prompts_sharing_no_token_are_never_cut_to_fit():
    with_sys = [episode([SYS, 40, USER, 50, ASSIST]) for _ in range(2)]
    without = [episode([USER, 50, ASSIST]) for _ in range(2)]
    samples = without[:1] + with_sys + without[1:]
    prompt = groups.common_prompt(samples, [9])
    # the earliest of the largest sets sharing a first token: here both sets have 2, the first sample's wins
    assert prompt == [USER, 50, ASSIST]
    stats = EnvStats()
    cfg = SimpleNamespace(min_group_samples=2)
    kept = groups.fitting(samples, prompt, cfg, 4, stats)
    assert kept == without and stats.totals["prompt_mismatch"] == 2 and stats.totals["samples_dropped"] == 2
    rebased = [groups.rebase(s, prompt) for s in kept]
    # what is trained is what each call sent: prompt + response equals the sample's own context
    assert all(prompt + s.token_ids == [USER, 50, ASSIST, 7, 8] for s in rebased)
    with pytest.raises(ValueError, match="does not start"):
        groups.rebase(with_sys[0], [USER])
    assert groups.fitting(samples, prompt, SimpleNamespace(min_group_samples=3), 4, EnvStats()) is None


def test_a_common_prefix_moves_the_rest_into_the_response_with_mask_0():
    a, b = episode([SYS, 40, USER, 50, ASSIST]), episode([SYS, 40, USER, 51, 52, ASSIST])
    prompt = groups.common_prompt([a, b], [9])
    assert prompt == [SYS, 40, USER]
    groups.rebase(b, prompt)
    assert b.token_ids == [51, 52, ASSIST, 7, 8] and b.loss_mask == [0, 0, 0, 1, 1]
    assert b.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
