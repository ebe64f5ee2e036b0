"""Weight sync end to end on CPU: a learner-side `WeightPublisher` here, `WeightReceiver`s driving real
engines, over files and over gloo. The gloo receivers of the last tests run in processes of their own
(tests/common/weightsync/weights_child.py), started by spawn and stopped by their handles / PIDs only."""

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
from fleetrl.common.config.schema import JobConfig, ModelConfig, RolloutConfig, SyncConfig
from fleetrl.common.messages import VersionAnnouncement, WeightsInfo, encode
from fleetrl.common.weightsync.receiver.receiver import WeightReceiver
from fleetrl.common.weightsync.sender.publisher import WeightPublisher
from fleetrl.rollout.engines import SamplingParams, create_engine
from tests.common.weightsync.weights_child import PROMPTS, CaptureEngine, run_receiver

TIMEOUT_S = 10.0
BUCKET_S = 2.0  # sync.bucket_timeout_s of the multi-process tests


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

    reference = create_engine(
        "hf",
        ModelConfig(path=save_reference(learner_model, tmp_path / "ref"), tokenizer=tiny_model_dir),
        RolloutConfig(),
        "cpu",
        0,
    )
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

            return pub.publish(
                version, version, perturb(learner_model, version).named_parameters(), announce, expected
            ), infos[-1]

        metrics, info = publish(1, 1)
        assert metrics["sync/receivers"] == 1 and metrics["sync/mb"] > 0 and len(info.buckets) > 1
        wait_pending(receiver, 1)
        assert receiver.apply(engine) == 1
        assert_same_weights(learner_model, engine.state)

        # announced too late: the round closed before the receiver joined -> it asks for a catch-up round,
        # which the learner serves from its host copy of version 2 (no publish needed)
        metrics, info = publish(2, 0, deliver=False)
        assert metrics["sync/receivers"] == 0
        receiver.on_version(2, info)
        wait_pending(receiver, 2)
        assert receiver.stats()["weights/catchups"] == 1 and receiver.stats()["weights/rounds_missed"] == 0
        assert receiver.apply(engine) == 2
        assert_same_weights(learner_model, engine.state)

        # the next round still reaches it, over the group formed in round 1
        group = pub._sender._group.id
        metrics, _ = publish(3, 1)
        assert metrics["sync/receivers"] == 1 and pub._sender._group.id == group
        wait_pending(receiver, 3)
        assert receiver.apply(engine) == 3
        assert_same_weights(learner_model, engine.state)

        # a plan this model cannot take is refused before joining; an older version is ignored
        bad = WeightsInfo(
            transport="gloo",
            master_addr="127.0.0.1",
            master_port=1,
            round_id=99,
            buckets=[[ws.make_spec("nope.weight", [2], "float32")]],
            published_at=time.time(),
        )
        receiver.on_version(4, bad)
        receiver.on_version(2, info)
        assert receiver.pending_version() is None and receiver.stats()["weights/rounds_missed"] == 1

        # a learner that resumed or rolled back publishes a LOWER version later: it wins
        metrics, _ = publish(1, 1)
        wait_pending(receiver, 1)
        assert receiver.apply(engine) == 1 and receiver.stats()["weights/version"] == 1
        assert_same_weights(learner_model, engine.state)
    finally:
        receiver.close()
        pub.close()


def test_a_stalled_receiver_holds_the_learner_about_one_bucket_timeout(learner_model, tmp_path, monkeypatch):
    import fleetrl.common.weightsync.receiver.broadcast as rounds

    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=30.0, bucket_timeout_s=1.0, bucket_mb=0.05))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    receiver = WeightReceiver(
        cfg, [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()], "cpu", "rollout-0"
    )
    release = threading.Event()
    monkeypatch.setattr(rounds, "receive_buckets", lambda *args, **kw: release.wait(30))  # joins, then never reads
    try:
        t0 = time.monotonic()
        metrics = pub.publish(1, 1, learner_model.named_parameters(), lambda info: receiver.on_version(1, info), 1)
        took = time.monotonic() - t0
        assert took < 2 * cfg.sync.bucket_timeout_s + 1.0, took  # not the round's 30 s: one bucket timeout, a re-form
        assert metrics["sync/failed"] == 1 and metrics["sync/receivers"] == 0 and metrics["sync/reforms"] >= 1
    finally:
        release.set()
        receiver.close()
        pub.close()


def test_after_a_round_that_closed_short_the_next_waits_a_moment_not_the_window(learner_model, tmp_path):
    """A registered server that stopped joining (its main loop stuck, CI of 2026-12-07) cost every round the
    whole join window. After a round closed short, the next closes SETTLE_S after as many joined as then; a
    round that fills ends the shortcut."""
    from fleetrl.common.weightsync.sender.broadcast import SETTLE_S

    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.1))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()]
    receiver = WeightReceiver(cfg, specs, "cpu", "rollout-0")  # the one that joins; a second is "registered"
    try:

        def publish(version: int, expected: int) -> tuple[dict, float]:
            t0 = time.monotonic()
            metrics = pub.publish(
                version,
                version,
                perturb(learner_model, version).named_parameters(),
                lambda info: receiver.on_version(version, info),
                expected,
            )
            wait_pending(receiver, version)
            receiver.apply(CaptureEngine(specs))
            return metrics, time.monotonic() - t0

        short, took = publish(1, 2)
        assert short["sync/receivers"] == 1 and took >= ws.JOIN_WINDOW_S - 0.5, took  # the whole window
        again, took = publish(2, 2)
        assert again["sync/receivers"] == 1 and SETTLE_S - 0.1 <= took < ws.JOIN_WINDOW_S - 1.5, took
        full, took = publish(3, 1)
        assert full["sync/receivers"] == 1 and took < SETTLE_S, took  # filled: no wait
        short, took = publish(4, 2)
        assert short["sync/receivers"] == 1 and took >= ws.JOIN_WINDOW_S - 0.5, took  # the window again
    finally:
        receiver.close()
        pub.close()


def test_an_overlapped_round_returns_once_announced_and_sends_the_weights_as_they_were(learner_model, tmp_path):
    """sync.overlap: `start` returns as soon as the version is announced, before any receiver joined (a
    synchronous publish waits for the join, up to its window); the round goes on beside the caller, which
    changes the weights at once, and the receiver still gets them as they were at `start`, in that round."""
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.1, overlap=True))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()]
    engine = CaptureEngine(specs)
    receiver = WeightReceiver(cfg, specs, "cpu", "rollout-0")
    infos: list[WeightsInfo] = []
    try:
        perturb(learner_model, 1)
        as_started = {n: p.detach().numpy().copy() for n, p in learner_model.named_parameters()}
        first = pub.start(1, 1, learner_model.named_parameters(), infos.append, 1)
        assert len(infos) == 1 and first["timing/sync_s"] < ws.JOIN_WINDOW_S / 2  # not held until a receiver joins
        assert "sync/receivers" not in first  # no round before it to report
        perturb(learner_model, 2)  # the next step changes the weights while the round waits for its receiver
        receiver.on_version(1, infos[0])  # the announcement reaches the receiver only now
        wait_pending(receiver, 1)
        assert receiver.apply(engine) == 1
        for name, value in as_started.items():
            assert np.array_equal(engine.state[name].numpy(), value), name
        assert receiver.stats()["weights/catchups"] == 0  # received in the round itself

        # the next start reports the round before it; a synchronous publish waits for the one in flight
        second = pub.start(2, 2, learner_model.named_parameters(), lambda info: receiver.on_version(2, info), 1)
        assert second["sync/receivers"] == 1 and second["sync/failed"] == 0 and second["sync/round_s"] > 0
        sent, seconds = pub.wait()
        assert sent.receivers == 1 and seconds > 0 and pub.wait() is None
        wait_pending(receiver, 2)
        assert receiver.apply(engine) == 2
        assert_same_weights(learner_model, engine.state)

        # an announcement that fails (the broker is gone) is raised on the caller's thread
        def unreachable(info: WeightsInfo) -> None:
            raise ConnectionError("no broker")

        with pytest.raises(ConnectionError, match="no broker"):
            pub.start(3, 3, learner_model.named_parameters(), unreachable, 1)
        third = pub.start(4, 4, learner_model.named_parameters(), lambda info: receiver.on_version(4, info), 1)
        assert "sync/receivers" not in third  # the failed round left nothing to report
        pub.close()  # waits for the round in flight: the last version reaches the fleet
        assert not [t for t in threading.enumerate() if t.name.startswith("fleetrl-publish")]
        wait_pending(receiver, 4)
        assert receiver.apply(engine) == 4
        assert_same_weights(learner_model, engine.state)
    finally:
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
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.05, bucket_timeout_s=BUCKET_S))
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


def test_gloo_receiver_killed_mid_round_costs_one_bucket_timeout_and_the_survivor_gets_the_version(fleet):
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
    took = time.monotonic() - t0
    killer.join(timeout=5)
    assert killed and took < 2 * BUCKET_S + 1.0, took  # the target: <= 2 x sync.bucket_timeout_s (+ packing)
    assert metrics["sync/failed"] == 0 and metrics["sync/receivers"] == 1 and metrics["sync/reforms"] == 1
    victim.proc.join(timeout=5)
    assert not victim.proc.is_alive()
    applied, state, stats, _ = kids["hf"].apply(4)  # the survivor got version 4, bit-exact
    assert applied == 4 and stats["weights/rounds_missed"] == 0
    assert_same_weights(model, state)

    # the next round, with a fresh receiver, reaches everyone
    metrics = sync_round(fleet, 5, ["hf", "b"])
    assert metrics["sync/receivers"] == 2 and metrics["sync/failed"] == 0
    for name in ("hf", "b"):
        applied, state, stats, _ = kids[name].apply(5)
        assert applied == 5 and stats["weights/rounds_missed"] == 0
        assert_same_weights(model, state)


# ------------------------------------------------------------------ the weight channel's defences


def test_the_round_store_listens_on_sync_master_addr_only(learner_model, tmp_path):
    import psutil

    cfg = JobConfig(sync=SyncConfig(transport="gloo", master_addr="127.0.0.1", timeout_s=TIMEOUT_S))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    try:
        pub.publish(1, 1, learner_model.named_parameters(), lambda info: None, 0)
        port = pub._sender.port
        listening = [
            c.laddr.ip
            for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port
        ]
        assert listening == ["127.0.0.1"]  # TCPStore alone listened on every interface
    finally:
        pub.close()


def test_joiners_without_the_round_secret_get_nothing_and_stall_nothing(learner_model, tmp_path):
    """An outsider that reaches the store: the old public keys lead nowhere, and a record under the real keys
    without the secret's proof is ignored and counted. The real receiver gets the version; nobody waits."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from fleetrl.common import messages

    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.1))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()]
    engine, receiver = CaptureEngine(specs), WeightReceiver(cfg, specs, "cpu", "rollout-0")
    try:

        def announce(info):
            outsider = TCPStore(info.master_addr, info.master_port, None, False, timeout=timedelta(seconds=2))
            assert outsider.add("round/1/count", 1) == 1  # the keys of the old protocol: nobody reads them now
            outsider.set("round/1/member/1", messages.encode_record(messages.JoinRecord("attacker/0")))
            keys = ws.RoundKeys(info.secret, info.round_id)  # even knowing the key names, without the secret:
            n = outsider.add(keys.count, 1)
            outsider.set(keys.member(n), messages.encode_record(messages.JoinRecord("attacker/1", proof="00" * 12)))
            receiver.on_version(1, info)

        t0 = time.monotonic()
        metrics = pub.publish(1, 1, perturb(learner_model, 1).named_parameters(), announce, 2)
        assert time.monotonic() - t0 < ws.JOIN_WINDOW_S + 2.0
        assert metrics["sync/receivers"] == 1 and metrics["sync/unknown_joiners"] == 1
        wait_pending(receiver, 1)
        assert receiver.apply(engine) == 1
        assert_same_weights(learner_model, engine.state)
    finally:
        receiver.close()
        pub.close()


def test_versions_from_the_future_are_ignored(tiny_model_dir, tmp_path):
    cfg = JobConfig(sync=SyncConfig(transport="filesystem"))
    receiver = WeightReceiver(cfg, [], "cpu", "rollout-0")
    future = WeightsInfo(transport="filesystem", path=str(tmp_path), published_at=time.time() + 10**6)
    receiver.on_version(9, future)  # it pinned every rollout to the attacker's weights: real 5 and 6 were ignored
    assert receiver.pending_version() is None and receiver.stats()["weights/rejected"] == 1
    receiver.on_version(5, WeightsInfo(transport="filesystem", path=str(tmp_path), published_at=time.time()))
    assert receiver.pending_version() == 5
