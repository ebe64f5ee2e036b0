"""A rollback really restores: after it no group with a token from a rolled-back version is trained, the
fleet is on the restored weights, the RNG and the LR are the checkpoint's (LR lowered), and the event
is on the timeline (events.jsonl, the trained log, a ``learner.rollback`` span)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from fleetrl.broker.client.inproc import InprocBroker
from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.common.telemetry import tracing
from fleetrl.learner import rollback as rollback_mod
from fleetrl.learner.runtime import init_distributed
from fleetrl.learner.train import Learner, train
from tests.broker.conftest import make_state

COLLAPSE_FROM = 5  # the "fleet" samples poor rewards from this policy version until the learner rolls back


@pytest.fixture(scope="module")
def dist():
    return init_distributed(load_config(None, ["learner.device=cpu"]))


class FakeFleet(threading.Thread):
    """A rollout server's pushes, scripted: groups at the broker's current version (tokens from that version
    and the one before), plus one *late* group per round two versions behind — the groups in flight when
    a rollback happens. Groups whose newest token comes from a collapsed version reward 0."""

    def __init__(self, broker: InprocBroker):
        super().__init__(daemon=True)
        self.broker, self.client = broker, broker.client("r0", "rollout")
        self.client.connect()
        self.rng = np.random.default_rng(0)
        self.versions: dict[str, tuple[int, int]] = {}  # group id -> (oldest, newest) token version
        self.halt = threading.Event()
        self.n = 0

    def bad(self, version: int) -> bool:
        ranges = self.broker.state.discarded_versions
        if ranges:  # rolled back: the discarded versions were the bad ones
            return any(lo <= version <= hi for lo, hi in ranges)
        return version >= COLLAPSE_FROM

    def group(self, oldest: int, newest: int) -> m.SampleGroup:
        rewards = [0.0, 0.0, 0.0, 1.0] if self.bad(newest) else [1.0, 1.0, 1.0, 0.0]  # mean 0.25 vs 0.75
        responses = [(self.rng.integers(7, 263, 3), np.full(3, -1.5)) for _ in rewards]
        versions = [np.array([oldest, newest, newest], dtype=np.int32) for _ in rewards]
        gid = f"f{self.n}"
        self.n += 1
        self.versions[gid] = (oldest, newest)
        return m.build_group(
            gid, f"0:{self.n % 400}", oldest, self.rng.integers(7, 263, 4), responses, rewards, token_versions=versions
        )

    def run(self) -> None:
        while not self.halt.is_set():
            with self.broker.lock:
                room = len(self.broker.state.q.queued) < 4 and not self.broker.state.paused
            if room:
                v = self.client.current_version().version
                batch = [self.group(max(v - 1, 0), v), self.group(v, v)]
                if v >= 2:
                    batch.append(self.group(v - 2, v - 1))  # a late group of an older version
                self.client.push_groups(batch)
            time.sleep(0.01)


def job(tiny_model_dir, tmp_path, *overrides):
    rule = "{name: reward_drop, action: rollback, window: 2, threshold: 0.3}"
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "learner.groups_per_step=2",
            "learner.lr=1e-3",
            "sync.transport=filesystem",
            f"run.dir={tmp_path}",
            "checkpoint.interval=2",
            "checkpoint.keep_last=10",
            "sync.keep_versions=100",
            "health.healthy_window=1",
            f"health.rules=[{rule}]",
            "health.max_rollbacks=3",
            "broker.max_staleness=100",
            "learner.total_steps=14",
            "learner.batch_wait_s=20",
            *overrides,
        ],
    )


def test_no_group_of_a_discarded_version_is_trained_after_the_rollback(dist, tiny_model_dir, tmp_path, monkeypatch):
    cfg = job(tiny_model_dir, tmp_path, "telemetry.exporter=jsonl")
    state = make_state(
        "broker.queue_capacity=100000",
        "broker.accept_unleased=true",
        "broker.max_staleness=100",
        n_prompts=400,
        vocab_size=263,
    )
    broker = InprocBroker(state)
    client = broker.client("learner-0", "learner")
    client.connect()
    restored = {}
    real_restore = rollback_mod.restore_state

    real_scale = Learner.set_lr_scale

    def spy_restore(parts, st):  # the RNG right after the restore must be the checkpoint's
        scale = real_restore(parts, st)
        restored.update(rng=torch.get_rng_state().clone(), saved=st["rng"]["torch"])
        return scale

    def spy_scale(learner, scale):  # the LR the restore leaves
        real_scale(learner, scale)
        restored.update(lr=learner.optimizer.param_groups[0]["lr"])

    monkeypatch.setattr(rollback_mod, "restore_state", spy_restore)
    monkeypatch.setattr(Learner, "set_lr_scale", spy_scale)
    fleet = FakeFleet(broker)
    fleet.start()
    try:
        assert train(cfg, tmp_path, client=client) == 0
        assert tracing.flush_tracing()
        spans = [s for s in tracing.read_spans(tmp_path) if s["name"] == "learner.rollback"]
    finally:
        fleet.halt.set()
        fleet.join(5)
        tracing.shutdown_tracing()
    log = [json.loads(line) for line in (tmp_path / "trained-0.jsonl").read_text().splitlines()]
    rollbacks = [i for i, row in enumerate(log) if "rollback" in row]
    assert rollbacks, "the collapse was not rolled back"
    for i in rollbacks:  # after each rollback, nothing with a token from its discarded versions is trained
        lo, hi = log[i]["discarded"]
        assert lo <= hi  # bad versions had been published
        trained_after = [gid for row in log[i + 1 :] if "group_ids" in row for gid in row["group_ids"]]
        assert trained_after, "training went on after the rollback"
        poisoned = [g for g in trained_after if fleet.versions[g][1] >= lo and fleet.versions[g][0] <= hi]
        assert poisoned == []
        assert log[i]["published_version"] > hi
    # the late groups of the bad versions did reach the broker and were dropped there, not trained
    assert state.counters["discarded"] > 0
    # RNG and LR restored (LR lowered)
    assert torch.equal(restored["rng"], torch.as_tensor(restored["saved"]))
    assert restored["lr"] < 1e-3
    assert len(spans) == len(rollbacks)  # the rollback on the trace timeline, with what it discarded
    assert spans[0]["attributes"]["fleetrl.rollback.discarded_min_version"] == log[rollbacks[0]]["discarded"][0]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["rule"] for e in events].count("rollback") >= 1
