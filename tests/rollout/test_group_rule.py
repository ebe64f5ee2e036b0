"""A group whose samples' prompts differ keeps every sample with its own prompt (issue 28): sessions opened
with and without a system message used to be trained under the first one's first token, then (a later
fix) the minority was dropped. Now nothing is cut, moved or dropped: the wire carries per-sample prompts."""

from __future__ import annotations

from fleetrl.common import messages as m
from fleetrl.rollout import group_rule as groups
from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.envs.base import Episode
from fleetrl.rollout.loop import Batch, build_groups
from fleetrl.rollout.rewards import RewardResult

SYS, USER, ASSIST = 1, 2, 3  # stand-ins for <|system|>, <|user|>, <|assistant|>


def episode(prompt, tokens=(7, 8)):
    return Episode(
        token_ids=list(tokens),
        logprobs=[-0.5] * len(tokens),
        finish_reason="stop",
        text="",
        prompt_ids=list(prompt),
        loss_mask=[1] * len(tokens),
        versions=[0] * len(tokens),
    )


def batch_of(samples, task_prompt):
    from concurrent.futures import Future

    lease = m.PromptLease(req_id=1, lease_id="L", expires_in_s=60.0, prompts=[m.Prompt(prompt_id="0:1", prompt="p")])
    return Batch(lease, [list(task_prompt)], [samples], 0, 0.1, Future())


def results(n):
    return [RewardResult(reward=float(i), parts={"r": float(i)}, failed=False) for i in range(n)]


def test_prompts_that_differ_are_each_kept_whole_on_the_wire():
    with_sys = [episode([SYS, 40, USER, 50, ASSIST], (7, 8, 9)) for _ in range(2)]
    without = [episode([USER, 50, ASSIST]) for _ in range(2)]
    samples = [without[0], with_sys[0], with_sys[1], without[1]]
    own = groups.own_prompts(samples, [9])
    assert groups.shared_prompt(own) is None
    [g], dropped, _ = build_groups(batch_of(samples, [9]), results(4), "s", lambda res: False)
    assert not dropped and g.num_responses == 4 and g.prompt_lengths == [3, 5, 5, 3]
    # decoded from the wire: each sample's prompt + response is exactly the context it was sampled from
    g = m.decode_group(m.encode(g))
    for i, s in enumerate(samples):
        assert g.prompt_of(i).tolist() + g.response_tokens(i).tolist() == s.prompt_ids + s.token_ids
    assert g.prompt_array().tolist() == sum((s.prompt_ids for s in samples), [])


def test_a_shared_prompt_goes_out_as_before():
    samples = [episode([USER, 50, ASSIST]), episode([USER, 50, ASSIST], (9,))]
    [g], _, _ = build_groups(batch_of(samples, [9]), results(2), "s", lambda res: False)
    assert g.prompt_lengths == [] and g.prompt_array().tolist() == [USER, 50, ASSIST]
    assert g.prompt_offsets() is None and g.prompt_of(1).tolist() == [USER, 50, ASSIST]
    plain = [Generation([5, 6], [-0.1, -0.2], "stop", "x"), Generation([5], [-0.1], "stop", "y")]
    [g], _, _ = build_groups(batch_of(plain, [4, 4, 4]), results(2), "s", lambda res: False)
    assert g.prompt_lengths == [] and g.prompt_array().tolist() == [4, 4, 4]  # plain generations: the task's
