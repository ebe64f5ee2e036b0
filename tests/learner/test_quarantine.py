"""One poisoning rollout server inside a learner's run: its groups are left out, the server is quarantined
at the broker within a few steps, and training goes on with the others; no rollback, no stop."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.learner.train import train
from tests.learner.conftest import inproc_client
from tests.learner.test_rollback import dist  # noqa: F401 - the process group fixture


def fleet_groups(steps: int, poison_from: int, zeros_from: int) -> list[m.SampleGroup]:
    """Per step 3 groups of the honest server "good" and one of "bad": from ``zeros_from`` its log-probs are
    exactly 0.0, from ``poison_from`` its rewards are -1e6 (the issue's poison)."""
    rng = np.random.default_rng(0)
    out = []
    for step in range(steps):
        for k, server in enumerate(("good", "good", "good", "bad")):
            rewards = [1.0, 0.0, 1.0, 0.0]
            zeros = server == "bad" and step >= zeros_from
            if server == "bad" and step >= poison_from:
                rewards = [-1e6] * 4
            responses = [(rng.integers(7, 263, 3), np.zeros(3) if zeros else np.full(3, -1.5)) for _ in rewards]
            out.append(
                m.build_group(
                    f"{server}-{step}-{k}",
                    f"0:{4 * step + k}",
                    0,
                    rng.integers(7, 263, 4),
                    responses,
                    rewards,
                    server_id=server,
                )
            )
    return out


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("poison_from, zeros_from", [(6, 100), (100, 0)], ids=["reward-1e6", "logprobs-0.0"])
def test_one_poisoning_server_is_quarantined_and_the_run_goes_on(
    dist,  # noqa: F811 - the fixture imported above
    tiny_model_dir,
    tmp_path,
    poison_from,
    zeros_from,
):
    # a reward_drop this sensitive (2-step window, 0.3) rolls back at once if the -1e6 rewards reach the metrics
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "learner.groups_per_step=4",
            "learner.lr=1e-4",
            "sync.transport=filesystem",
            f"run.dir={tmp_path}",
            "checkpoint.interval=2",
            "sync.keep_versions=100",
            "learner.total_steps=14",
            "broker.max_staleness=100",
            "health.rules=[{name: reward_drop, action: rollback, window: 2, threshold: 0.3}, {name: non_finite, action: stop},"
            " {name: server_poison, action: quarantine}]",
        ],
    )
    # a python reward declares no range, so the broker's own plausibility check (issue 31) lets -1e6 through
    # (its bound is broker.max_abs_reward); with a declared range the broker refuses those groups first
    client, broker = inproc_client(
        fleet_groups(30, poison_from, zeros_from),
        "broker.max_staleness=100",
        "rollout.rewards=[{name: python, args: {function: 'tests.rollout.user_rewards:contains_answer'}}]",
    )
    first = min(poison_from, zeros_from)
    assert train(cfg, tmp_path, client=client) == 0
    events = rows_of(tmp_path / "events.jsonl")
    assert [e["rule"] for e in events] == ["server_poison"], events  # nothing else fired: no rollback, no stop
    (q,) = events
    assert q["action"] == "quarantine" and q["server"] == "bad" and q["step"] == first + 3  # its 3rd screened group
    assert broker.state.controls.quarantined.keys() == {"bad"}
    trained = [r for r in rows_of(tmp_path / "trained-0.jsonl") if "step" in r]
    assert trained[-1]["step"] == 14  # training went on to the end
    poisoned = {f"bad-{s}-3" for s in range(first, 30)}
    assert not poisoned & {gid for r in trained for gid in r["group_ids"]}  # no poisoned group was trained
    screened = {gid for r in trained for gid in r.get("screened_ids", [])}
    assert {f"bad-{s}-3" for s in range(first, first + 3)} <= screened
    metrics = rows_of(tmp_path / "metrics.jsonl")
    assert min(r["reward/mean"] for r in metrics if "reward/mean" in r) >= 0.0
    assert metrics[-1]["fleet/quarantined_servers"] == 1.0
