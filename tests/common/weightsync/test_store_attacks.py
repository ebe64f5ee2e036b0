"""Issue 31: the weight channel's TCPStore is open to whoever reaches it (``list_keys`` shows every key), and
every rollout knows the round's secret. Each attack below once forged weights, leaked a secret, hung or
crashed the learner; now the learner signs what receivers act on and bounds what it reads from the store."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from fleetrl.common import messages
from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig, SyncConfig
from fleetrl.common.weightsync.receiver import broadcast as rounds
from fleetrl.common.weightsync.receiver.receiver import WeightReceiver
from fleetrl.common.weightsync.sender.publisher import WeightPublisher
from tests.common.weightsync.test_receiver import CaptureEngine, assert_same_weights, perturb, specs_of, wait_pending  # noqa: F401  # noqa: F401

TIMEOUT_S = 10.0


def outsider(info: messages.WeightsInfo) -> TCPStore:
    """A client of the learner's store with no key and no secret."""
    return TCPStore(info.master_addr, info.master_port, None, False, timeout=timedelta(seconds=2))


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=2), wait_for_workers=False)
    yield server


def test_a_plan_signed_by_anyone_but_the_learner_is_refused(store):
    """A rollout holding the round's secret wrote RoundPlan(group='evil', ranks={victim: 1}) and the victim took it."""
    learner, attacker = ws.Signer(), ws.Signer()
    keys = ws.RoundKeys(ws.new_secret(), 7)
    forged = messages.RoundPlan(group="evil", size=2, ranks={"victim/0": 1})
    forged.sig = attacker.sign(ws.auth.plan_message(keys.round_id, forged))
    store.set(keys.plan, messages.encode_record(forged))
    with pytest.raises(rounds.RoundSkipped, match="signed by the learner"):
        rounds.signed_plan(store, keys, learner.public, time.monotonic() + 0.3)
    unsigned = messages.RoundPlan(group="evil", size=2, ranks={"victim/0": 1})
    store.set(keys.plan, messages.encode_record(unsigned))
    with pytest.raises(rounds.RoundSkipped):
        rounds.signed_plan(store, keys, learner.public, time.monotonic() + 0.3)
    replayed = messages.RoundPlan(group="3", size=2, ranks={"victim/0": 1})  # the learner's, from another round
    replayed.sig = learner.sign(ws.auth.plan_message(keys.round_id - 1, replayed))
    store.set(keys.plan, messages.encode_record(replayed))
    with pytest.raises(rounds.RoundSkipped):
        rounds.signed_plan(store, keys, learner.public, time.monotonic() + 0.3)
    real = messages.RoundPlan(group="7", size=2, ranks={"victim/0": 1})
    real.sig = learner.sign(ws.auth.plan_message(keys.round_id, real))
    store.set(keys.plan, messages.encode_record(real))
    assert rounds.signed_plan(store, keys, learner.public, time.monotonic() + 0.3).group == "7"


def test_a_bucket_whose_bytes_are_not_the_learners_is_refused(store):
    """The forged broadcast (every value 666.0) was loaded by the victim; now its digest does not match."""
    learner, attacker = ws.Signer(), ws.Signer()
    keys = ws.RoundKeys(ws.new_secret(), 3)
    real = torch.arange(64, dtype=torch.bfloat16)
    dig = ws.digest(real.view(torch.uint8).numpy())
    store.set(
        keys.seal(0), messages.encode_record(messages.BucketSeal(dig, learner.sign(ws.auth.seal_message(3, 0, dig))))
    )
    rounds.check_seal(store, keys, 0, real.clone(), learner.public, 1.0)  # the learner's bytes pass
    forged = torch.full((64,), 666.0, dtype=torch.bfloat16)
    with pytest.raises(ws.BucketForged, match="not the ones the learner signed"):
        rounds.check_seal(store, keys, 0, forged, learner.public, 1.0)
    fdig = ws.digest(forged.view(torch.uint8).numpy())  # the forger seals its own bytes with its own key
    store.set(
        keys.seal(0), messages.encode_record(messages.BucketSeal(fdig, attacker.sign(ws.auth.seal_message(3, 0, fdig))))
    )
    with pytest.raises(ws.BucketForged, match="not signed by the learner"):
        rounds.check_seal(store, keys, 0, forged, learner.public, 1.0)
    with pytest.raises(ws.BucketForged):  # the learner's seal of bucket 0 of another round does not fit round 3
        seal = messages.BucketSeal(fdig, learner.sign(ws.auth.seal_message(2, 0, fdig)))
        store.set(keys.seal(0), messages.encode_record(seal))
        rounds.check_seal(store, keys, 0, forged, learner.public, 1.0)


def test_a_secret_is_never_in_clear_in_the_store():
    sealed = ws.auth.seal_secret("ab" * 16, "offer/5", "cd" * 16)
    assert sealed != "cd" * 16 and ws.auth.open_secret("ab" * 16, "offer/5", sealed) == "cd" * 16
    assert ws.auth.open_secret("ef" * 16, "offer/5", sealed) != "cd" * 16  # without the missed round's secret


@pytest.mark.parametrize("added", [ws.CLOSED, 1_000_000])
def test_a_non_member_adding_to_the_join_counter_neither_hangs_nor_crashes_the_learner(learner_model, tmp_path, added):
    """add(count, CLOSED): the publish never returned and RSS grew ~50 MiB/s; add(count, 1_000_000):
    UnboundLocalError in BroadcastSender.send. Now the counter is read as tampered, the learner takes the join
    records present (the real receiver's), and the receiver gets the version."""
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.1))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()]
    engine, receiver = CaptureEngine(specs), WeightReceiver(cfg, specs, "cpu", "rollout-0")
    try:

        def announce(info):
            receiver.on_version(1, info)
            other = outsider(info)
            deadline = time.monotonic() + TIMEOUT_S
            count = None
            while count is None and time.monotonic() < deadline:  # the outsider finds the count key by listing
                count = next((k for k in other.list_keys() if k.endswith("/count") and k.startswith("round/")), None)
                time.sleep(0.01)
            assert count is not None
            while other.add(count, 0) < 1:
                time.sleep(0.01)
            other.add(count, added)

        t0 = time.monotonic()
        metrics = pub.publish(1, 1, perturb(learner_model, 1).named_parameters(), announce, 2)
        assert time.monotonic() - t0 < ws.JOIN_WINDOW_S + 5.0
        assert metrics["sync/tampered"] == 1 and metrics["sync/receivers"] == 1
        wait_pending(receiver, 1)
        assert receiver.apply(engine) == 1
        assert_same_weights(learner_model, engine.state)
    finally:
        receiver.close()
        pub.close()


def test_big_sets_by_a_non_member_are_swept_at_the_next_publish(learner_model, tmp_path):
    """128 SETs of 8 MiB grew the learner's RSS by 1 GiB and stayed; now keys no round uses are deleted.
    (catchup off: its poll sweeps every 0.5 s too, which would race the SETs this test checks first.)"""
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.1, catchup=False))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    infos = []
    try:
        pub.publish(1, 1, learner_model.named_parameters(), infos.append, 0)
        other = outsider(infos[0])
        junk = b"\0" * (8 << 20)
        for i in range(8):
            other.set(f"junk/{i}", junk)
        other.set("x" * 1000, b"1")  # an over-long key name, anywhere
        assert other.check([f"junk/{i}" for i in range(8)] + ["x" * 1000])  # every SET has landed
        pub.publish(2, 2, learner_model.named_parameters(), infos.append, 0)
        left = other.list_keys()
        assert not [k for k in left if k.startswith("junk/") or len(k) > ws.MAX_KEY_CHARS]
    finally:
        pub.close()


def test_the_learners_own_catchup_keys_are_deleted_not_swept_as_an_outsiders(
    learner_model, tmp_path, monkeypatch, caplog
):
    """The catch-up poll reads each round's request counter with add(request, 0), which makes the key; it was
    never deleted, so 16 rounds later the sweep removed it as "someone who can reach sync.master_addr wrote
    them" (269 such warnings in a quiet 3-minute demo, no outsider anywhere). Now the round's catch-up keys go
    with its other keys, and a run with no outsider sweeps nothing."""
    from fleetrl.common.weightsync.sender import broadcast as sender

    monkeypatch.setattr(sender, "CATCHUP_POLL_S", 0.01)
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=TIMEOUT_S, bucket_mb=0.1))
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(learner_model))
    infos: list[messages.WeightsInfo] = []
    try:
        with caplog.at_level("WARNING", logger="fleetrl"):
            for v in range(1, 25):
                pub.publish(v, v, learner_model.named_parameters(), infos.append, 0)
                other = outsider(infos[-1])
                asked = ws.CatchupKeys(infos[-1].secret, infos[-1].round_id).request
                deadline = time.monotonic() + TIMEOUT_S
                while not other.check([asked]):  # the poll has read this round's counter
                    assert time.monotonic() < deadline, "the catch-up poll never read the round's counter"
                    time.sleep(0.01)
        swept = [r.getMessage() for r in caplog.records if "no round of this learner uses" in r.getMessage()]
        assert swept == []
        catchup_keys = [k for k in other.list_keys() if k.startswith("catchup/")]
        assert 0 < len(catchup_keys) <= 6  # the last rounds' only, not one per round published
    finally:
        pub.close()


def forged_rounds_are_refused(receiver, plan: list, held: Callable[[], object]) -> None:
    """Drive ``receiver`` (a `WeightReceiver`, or a vLLM engine's `WorkerReceivers`) through two rounds it
    must refuse: one announced with no signing key, and one whose plan in the store (a store of the
    attacker's own: what a rollout holding the round's secret can write into the learner's) is signed by
    someone other than the announced learner. ``held()`` (the weights or outputs) must not change."""
    learner_key, attacker_key = ws.Signer(), ws.Signer()
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    before = held()

    unsigned = ws.RoundKeys(ws.new_secret(), 1)  # a learner of an older version: refused before joining
    receiver.on_version(
        1,
        messages.WeightsInfo(
            transport="gloo",
            master_addr="127.0.0.1",
            master_port=store.port,
            round_id=1,
            secret=unsigned.secret,
            buckets=plan,
            published_at=time.time(),
        ),
    )
    deadline = time.monotonic() + 30
    while receiver.pending_version() is not None or receiver.stats().get("weights/rounds_missed", 0) < 1:
        assert time.monotonic() < deadline, "the unsigned announcement was not refused"
        time.sleep(0.05)
    assert not store.check([unsigned.count])

    keys = ws.RoundKeys(ws.new_secret(), 2)  # the learner's key announced, the attacker's plan in the store
    receiver.on_version(
        2,
        messages.WeightsInfo(
            transport="gloo",
            master_addr="127.0.0.1",
            master_port=store.port,
            round_id=2,
            secret=keys.secret,
            buckets=plan,
            published_at=time.time(),
            signer=learner_key.public,
        ),
    )
    store.wait([keys.member(1)], timedelta(seconds=30))
    victim = messages.decode_join(store.get(keys.member(1))).identity
    forged = messages.RoundPlan(group="evil", size=2, ranks={victim: 1})
    forged.sig = attacker_key.sign(ws.auth.plan_message(keys.round_id, forged))
    store.set(keys.plan, messages.encode_record(forged))
    # it waits out its deadline for a plan the learner signed, then asks for a catch-up round; it never took
    # the forged plan: no rendezvous of group "evil", no re-formed round joined
    store.wait([ws.CatchupKeys(keys.secret, keys.round_id).request], timedelta(seconds=30))
    assert not [k for k in store.list_keys() if k.startswith(keys.group("evil"))]
    assert not store.check([keys.reform(0).count])
    assert receiver.pending_version() is None
    assert held() == before


def test_a_receiver_takes_only_rounds_the_learner_signed(learner_model):
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=2, bucket_mb=0.1))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in learner_model.named_parameters()]
    receiver = WeightReceiver(cfg, specs, "cpu", "rollout-0")
    try:
        forged_rounds_are_refused(
            receiver,
            ws.plan_buckets(specs_of(learner_model), int(0.1 * ws.MB)),
            lambda: receiver.stats()["weights/version"],
        )
    finally:
        receiver.close()
