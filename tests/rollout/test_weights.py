"""Weight sync end to end on CPU: a learner-side `WeightPublisher` here, `WeightReceiver`s driving real
engines, over files and over gloo. The gloo receivers of the last tests run in processes of their own
(tests/rollout/weights_child.py), started by spawn and stopped by their handles / PIDs only."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.common import weightsync as ws
from fleetrl.common.messages import VersionAnnouncement, WeightsInfo, encode
from fleetrl.common.config.schema import JobConfig, ModelConfig, RolloutConfig, SyncConfig
from fleetrl.learner.weights import WeightPublisher
from fleetrl.rollout.engines import SamplingParams, create_engine
from fleetrl.rollout.weights import WeightReceiver
from tests.rollout.weights_child import PROMPTS, CaptureEngine, run_receiver

TIMEOUT_S = 10.0


def perturb(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def specs_of(model):
    return [ws.make_spec(n, p.shape, p.dtype) for n, p in model.named_parameters()]


def assert_same_weights(model, state: dict) -> None:
    params = dict(model.named_parameters())
    assert set(state) >= set(params)
    for name, p in params.items():
        assert np.array_equal(p.detach().numpy(), np.asarray(state[name])), name


def greedy(engine):
    prompts = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    out = engine.generate_batch(prompts, SamplingParams(temperature=0.0, max_new_tokens=12), 1)
    return [[(g.token_ids, g.logprobs) for g in group] for group in out]


@pytest.fixture
def learner_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def save_reference(model, path) -> str:
    model.save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------- filesystem


def test_filesystem_update_gives_exactly_the_new_models_outputs(tiny_model_dir, learner_model, tmp_path):
    cfg = JobConfig(sync=SyncConfig(transport="filesystem", keep_versions=2))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    engine = create_engine("hf", ModelConfig(path=tiny_model_dir), RolloutConfig(), "cpu", 0)
    receiver = WeightReceiver(cfg, engine.param_specs(), "cpu", "rollout-0")
    before = greedy(engine)

    announced: list[WeightsInfo] = []
    perturb(learner_model, 1)
    pub.publish(1, 1, learner_model.named_parameters(), announced.append, 1)
    receiver.on_version(1, announced[-1])
    assert receiver.pending_version() == 1
    assert receiver.apply(engine) == 1
    assert receiver.apply(engine) is None  # nothing new
    receiver.on_version(1, announced[-1])  # a repeated announcement is ignored
    assert receiver.pending_version() is None

    reference = create_engine("hf", ModelConfig(path=save_reference(learner_model, tmp_path / "ref"),
                                                tokenizer=tiny_model_dir), RolloutConfig(), "cpu", 0)
    after = greedy(engine)
    assert after == greedy(reference) and after != before
    assert receiver.stats()["weights/version"] == 1

    # a server busy generating sees three versions go by: it loads only the newest
    for version in (2, 3, 4):
        pub.publish(version, version, perturb(learner_model, version).named_parameters(), announced.append, 1)
        receiver.on_version(version, announced[-1])
    receiver.on_version(3, announced[-2])  # late, older: ignored
    assert receiver.apply(engine) == 4
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v3", "v4"]
    assert_same_weights(learner_model, {n: p.detach().numpy() for n, p in engine.model.named_parameters()})

    # a version pruned before the server got to it is skipped, not fatal
    receiver.on_version(9, WeightsInfo(transport="filesystem", path=str(tmp_path / "weights" / "v9")))
    assert receiver.apply(engine) is None and receiver.stats()["weights/version"] == 4
    receiver.close()


# ------------------------------------------------------------------- gloo, one process


def test_gloo_rounds_in_process_late_join_and_mismatch(learner_model, tmp_path):
    """The round protocol with the receiver's thread in this process: fast checks of its rules."""
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.1))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()]
    engine = CaptureEngine(specs)
    receiver = WeightReceiver(cfg, specs, "cpu", "rollout-0")
    try:
        def publish(version: int, expected: int, deliver: bool = True):
            infos: list[WeightsInfo] = []

            def announce(info):
                infos.append(info)
                if deliver:
                    receiver.on_version(version, info)

            return pub.publish(version, version, perturb(learner_model, version).named_parameters(), announce,
                               expected), infos[-1]

        metrics, info = publish(1, 1)
        assert metrics["sync/receivers"] == 1 and metrics["sync/mb"] > 0 and len(info.buckets) > 1
        wait_pending(receiver, 1)
        assert receiver.apply(engine) == 1
        assert_same_weights(learner_model, engine.state)

        # announced too late: the round closed before the receiver joined -> missed, nothing pending
        metrics, info = publish(2, 0, deliver=False)
        assert metrics["sync/receivers"] == 0
        receiver.on_version(2, info)
        wait_for(lambda: receiver.stats()["weights/rounds_missed"] == 1)
        assert receiver.pending_version() is None

        # the next round still reaches it, over the group formed in round 1
        group = pub._sender._group.id
        metrics, _ = publish(3, 1)
        assert metrics["sync/receivers"] == 1 and pub._sender._group.id == group
        wait_pending(receiver, 3)
        assert receiver.apply(engine) == 3
        assert_same_weights(learner_model, engine.state)

        # a plan this model cannot take is refused before joining; an older version is ignored
        bad = WeightsInfo(transport="gloo", master_addr="127.0.0.1", master_port=1, round_id=99,
                          buckets=[[ws.make_spec("nope.weight", [2], "float32")]], published_at=time.time())
        receiver.on_version(4, bad)
        receiver.on_version(2, info)
        assert receiver.pending_version() is None and receiver.stats()["weights/rounds_missed"] == 2

        # a learner that resumed or rolled back publishes a LOWER version later: it wins
        metrics, _ = publish(1, 1)
        wait_pending(receiver, 1)
        assert receiver.apply(engine) == 1 and receiver.stats()["weights/version"] == 1
        assert_same_weights(learner_model, engine.state)
    finally:
        receiver.close()
        pub.close()


def test_a_receiver_too_late_for_a_round_is_seen_and_served_by_a_catch_up_round(learner_model, tmp_path):
    """The gloo-resume deadlock's cause and fix at the protocol level: a resumed learner's first round closed
    before the new rollout joined; the rollout's join attempt leaves a count on the closed round, which the
    learner reads while it waits for groups, and a second round of the same version reaches the rollout."""
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()]
    engine = CaptureEngine(specs)
    receiver = WeightReceiver(cfg, specs, "cpu", "rollout-0")
    try:
        infos: list[WeightsInfo] = []
        perturb(learner_model, 7)
        pub.publish(5, 5, learner_model.named_parameters(), infos.append, 0)  # nobody expected: closes at once
        assert pub.late_receivers() == 0
        receiver.on_version(5, infos[-1])  # the rollout registered just too late
        wait_for(lambda: receiver.stats()["weights/rounds_missed"] == 1)
        assert pub.late_receivers() == 1 and receiver.pending_version() is None
        receiver.on_version(5, infos[-1])  # its catch-up poll retries the closed round: still late
        wait_for(lambda: receiver.stats()["weights/rounds_missed"] == 2)
        assert pub.late_receivers() == 2
        metrics = pub.publish(5, 5, learner_model.named_parameters(), lambda info: receiver.on_version(5, info), 1)
        assert metrics["sync/receivers"] == 1  # the same version again, in a new round
        wait_pending(receiver, 5)
        assert receiver.apply(engine) == 5 and pub.late_receivers() == 0
        assert_same_weights(learner_model, engine.state)
    finally:
        receiver.close()
        pub.close()


def test_a_stalled_receiver_holds_the_learner_at_most_timeout_s(learner_model, tmp_path):
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=2.0))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    receiver = WeightReceiver(cfg, [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()],
                              "cpu", "rollout-0")
    release = threading.Event()
    receiver._recv_bucket = lambda *args: release.wait(30)  # joins and forms the group, then never reads
    try:
        t0 = time.monotonic()
        metrics = pub.publish(1, 1, learner_model.named_parameters(), lambda info: receiver.on_version(1, info), 1)
        assert time.monotonic() - t0 < 2.0 + 1.0  # the round's deadline, plus the tensors' packing
        assert metrics["sync/failed"] == 1 and metrics["sync/receivers"] == 0
    finally:
        release.set()
        receiver.close()
        pub.close()


def wait_for(cond, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def wait_pending(receiver: WeightReceiver, version: int) -> None:
    wait_for(lambda: (receiver.pending_version() or 0) >= version)


# -------------------------------------------------------------- gloo, separate processes


@dataclass
class Child:
    """A receiver process; stopped through its queue, else killed by its own PID."""

    name: str
    proc: mp.Process
    cmd_q: mp.Queue
    out_q: mp.Queue

    def announce(self, version: int, info: WeightsInfo) -> None:
        self.cmd_q.put(("version", encode(VersionAnnouncement(version=version, step=version, weights=info))))

    def apply(self, version: int, ref_dir: str | None = None):
        self.cmd_q.put(("apply", version, TIMEOUT_S, ref_dir))
        tag, applied, state, stats, greedy_pair = self.out_q.get(timeout=TIMEOUT_S + 60)
        assert tag == "applied"
        return applied, state, stats, greedy_pair

    def stop(self) -> None:
        if self.proc.is_alive():
            self.cmd_q.put(("stop",))
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(timeout=5)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """A gloo publisher here and three receiver processes: `hf` (an HF engine), `a` and `b` (capture)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.05))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    ctx = mp.get_context("spawn")
    kids: dict[str, Child] = {}
    try:
        for name, model_dir in (("hf", tiny_model_dir), ("a", None), ("b", None)):
            cmd_q, out_q = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=run_receiver, args=(cfg, name, model_dir, specs, cmd_q, out_q), daemon=True)
            proc.start()
            kids[name] = Child(name, proc, cmd_q, out_q)
        for kid in kids.values():
            assert kid.out_q.get(timeout=120)[0] == "ready"
        pub = WeightPublisher(cfg, tmp_path_factory.mktemp("run"), 0, specs_of(model))
        yield model, pub, kids
        pub.close()
    finally:
        for kid in kids.values():
            kid.stop()


def sync_round(fleet, version: int, members: list[str]) -> dict[str, float]:
    model, pub, kids = fleet
    perturb(model, version)

    def announce(info: WeightsInfo) -> None:
        for name in members:
            kids[name].announce(version, info)

    return pub.publish(version, version, model.named_parameters(), announce, len(members))


def test_gloo_update_in_another_process_is_bit_exact_and_reuses_the_group(fleet, tmp_path):
    model, pub, kids = fleet
    metrics = sync_round(fleet, 1, ["hf"])
    assert metrics["sync/receivers"] == 1 and metrics["sync/failed"] == 0
    applied, state, _, (got, want) = kids["hf"].apply(1, save_reference(model, tmp_path / "v1"))
    assert applied == 1
    assert_same_weights(model, state)
    assert got == want  # greedy tokens and log-probs of a fresh engine loaded with the new weights

    group = pub._sender._group.id
    metrics = sync_round(fleet, 2, ["hf"])
    assert metrics["sync/receivers"] == 1 and pub._sender._group.id == group  # same member: same group
    applied, state, stats, _ = kids["hf"].apply(2)
    assert applied == 2 and stats["weights/rounds_ok"] == 2
    assert_same_weights(model, state)


def test_gloo_two_receivers_in_one_round_both_match(fleet):
    model, pub, kids = fleet
    metrics = sync_round(fleet, 3, ["hf", "a"])
    assert metrics["sync/receivers"] == 2
    for name in ("hf", "a"):
        applied, state, _, _ = kids[name].apply(3)
        assert applied == 3
        assert_same_weights(model, state)


def test_gloo_receiver_killed_mid_round_fails_the_round_not_the_learner(fleet):
    model, pub, kids = fleet
    victim = kids["a"]
    victim.cmd_q.put(("stall",))
    killed = []

    def kill_when_stalled():
        tag, pid = victim.out_q.get(timeout=TIMEOUT_S)
        assert tag == "stalled" and pid == victim.proc.pid
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_when_stalled, daemon=True)
    killer.start()
    t0 = time.monotonic()
    metrics = sync_round(fleet, 4, ["hf", "a"])
    assert time.monotonic() - t0 < TIMEOUT_S
    killer.join(timeout=5)
    assert killed and metrics["sync/failed"] == 1 and metrics["sync/receivers"] == 0
    victim.proc.join(timeout=5)
    assert not victim.proc.is_alive()

    # the next round, with a fresh receiver, reaches everyone; `hf` missed version 4 and catches up
    metrics = sync_round(fleet, 5, ["hf", "b"])
    assert metrics["sync/receivers"] == 2 and metrics["sync/failed"] == 0
    missed = {}
    for name in ("hf", "b"):
        applied, state, stats, _ = kids[name].apply(5)
        assert applied == 5
        assert_same_weights(model, state)
        missed[name] = stats["weights/rounds_missed"]
    assert missed == {"hf": 1, "b": 0}
