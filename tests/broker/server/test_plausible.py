"""Plausibility at ingest, per group, counted per server (issue 31, item 3 of its list): one rollout pushing
in-bounds poison (rewards of -1e6: 44 groups accepted; behaviour log-probs of 0.0: 60 groups) tripped
`reward_drop` / `mismatch_kl_ceiling`, which rolled back three times and stopped the learner."""

from __future__ import annotations

import numpy as np
import pytest

from fleetrl.broker.client.inproc import InprocBroker
from fleetrl.broker.client.metrics import status_metrics
from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.common.config.rewards import declared_reward_range
from tests.broker.conftest import make_state
from tests.broker.server.test_state import lease_prompts, publish, push


def group(prompt_id: str, rewards=(0.0, 1.0), logp: float = -0.7, t: int = 12, gid: str | None = None, **kw):
    import uuid

    return m.build_group(
        gid or uuid.uuid4().hex,
        prompt_id,
        0,
        [1, 2, 3],
        [(np.full(t, 5), np.full(t, logp)) for _ in rewards],
        list(rewards),
        **kw,
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], (0.0, 1.0)),  # the default: math
        (
            [
                "rollout.rewards=[{name: exact, weight: 2}, {name: regex, weight: 0.5, args: {pattern: x, hit: 1, miss: -1}}]"
            ],
            (-0.5, 2.5),
        ),
        (["rollout.rewards=[{name: length, args: {target: 4, max_penalty: 1, truncation_penalty: 0.5}}]"], (-1.5, 0.0)),
        (
            ["rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:boom'}, range: [-3, 7]}]"],
            (-3.0, 7.0),
        ),
        (["rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:boom'}}]"], None),
        (["rollout.rewards=[{name: length, args: {target: 4}}]"], None),  # no cap: no lower bound
        (["rollout.env.type=http", "rollout.env.http.url=http://127.0.0.1:9"], None),  # the environment may reward
    ],
)
def test_the_jobs_declared_reward_range(overrides, expected):
    assert declared_reward_range(load_config(None, overrides).rollout) == expected


def test_rewards_outside_the_declared_range_are_refused_and_counted_per_client():
    broker = InprocBroker(make_state("broker.max_staleness=100", n_prompts=50))
    bad, good = broker.client("rollout-bad", "rollout"), broker.client("rollout-good", "rollout")
    bad.connect(), good.connect()
    state = broker.state
    prompts = bad.lease_prompts(8, 0).prompts
    poison = [group(p.prompt_id, rewards=(-1e6, -1e6), gid=f"poison-{i}") for i, p in enumerate(prompts[:4])]
    poison.append(group(prompts[4].prompt_id, rewards=(1.5, 0.0), gid="slightly-over"))
    acks = bad.push_groups(poison)
    assert [a.status for a in acks] == ["rejected"] * 5 and {a.code for a in acks} == {"implausible_reward"}
    assert "outside the job's declared range [0, 1]" in acks[0].reason and "rollout.rewards[].range" in acks[0].reason
    assert bad.push_groups([group(prompts[5].prompt_id, rewards=(1.0, 0.0))])[0].status == "accepted"
    (mine,) = good.lease_prompts(1, 0).prompts
    assert good.push_groups([group(mine.prompt_id)])[0].status == "accepted"  # other servers are not affected
    status = state.status(1, 0.0)
    rows = {c.client_id: c for c in status.clients}
    assert rows["rollout-bad"].counters == {"implausible/reward": 5} and rows["rollout-good"].counters == {}
    assert status.counters["implausible/reward"] == 5 and state.rejected["invalid_group"] == 5
    metrics = status_metrics(status)
    assert metrics["broker/implausible"] == 5 and metrics["broker/implausible/rollout-bad"] == 5
    assert "broker/implausible/rollout-good" not in metrics
    from rich.console import Console

    from fleetrl.broker.client.status import render

    console = Console(width=160, record=True)
    console.print(render(status))
    assert "alive, 5 implausible/reward" in console.export_text()  # `fleetrl status` shows the server's count
    bad.connect()  # it registers again (a restart keeps its id only with its pid; here, the same id): still counted
    assert {c.client_id: c for c in state.status(2, 0.0).clients}["rollout-bad"].counters == {"implausible/reward": 5}


def test_without_a_declared_range_the_finite_bound_applies_and_baselines_are_checked():
    state = make_state("rollout.rewards=[{name: length, args: {target: 4}}]")
    (p, q) = lease_prompts(state, 2).prompts
    refused = push(state, group(p.prompt_id, rewards=(-2e6, 0.0)))
    assert refused.code == "invalid_group" and "broker.max_abs_reward=1e+06" in refused.reason
    assert push(state, group(p.prompt_id, rewards=(-300.0, 0.0))).count == 1
    ranged = make_state()
    (p,) = lease_prompts(ranged, 1).prompts
    assert "declared range" in push(ranged, group(p.prompt_id, baseline_reward=4.0)).reason
    assert ranged.clients.tallies["r0"] == {"implausible/reward": 1}


def test_behaviour_logprobs_of_exactly_zero_are_implausible_at_temperature():
    state = make_state()
    publish(state, 0)
    prompts = lease_prompts(state, 6).prompts
    zeros = push(state, group(prompts[0].prompt_id, logp=0.0))  # 24 sampled tokens, every one 0.0
    assert zeros.code == "invalid_group" and "exactly 0.0" in zeros.reason
    some = group(prompts[1].prompt_id, logp=-0.5)
    some.logprobs = np.where(np.arange(24) % 3 == 0, 0.0, -0.5).astype("<f4").tobytes()  # a third: confident tokens
    assert push(state, some).count == 1
    short = group(prompts[2].prompt_id, logp=0.0, t=4)  # 8 tokens: too few to judge
    assert push(state, short).count == 1
    masked = group(prompts[3].prompt_id, logp=0.0, t=20, loss_masks=[np.r_[np.zeros(18), 1, 1]] * 2)
    assert push(state, masked).count == 1  # appended (mask 0) tokens' log-probs are not behaviour log-probs
    assert state.clients.tallies["r0"] == {"implausible/logprob": 1}
    greedy = make_state("rollout.temperature=0")
    (p,) = lease_prompts(greedy, 1).prompts
    assert push(greedy, group(p.prompt_id, logp=0.0)).count == 1
    off = make_state("broker.max_zero_logprob_fraction=1.5")
    (p,) = lease_prompts(off, 1).prompts
    assert push(off, group(p.prompt_id, logp=0.0)).count == 1
