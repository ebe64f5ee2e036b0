"""Wire fuzzing of a live `fleetrl broker` (a child process): it answers or drops every frame, never dies,
stays within bounded memory, and keeps serving a well-behaved client throughout.

Each hypothesis example is one batch of ~29 frames sent over a raw DEALER socket: requests of every
type with random field values (``fuzz_strategies.request_array``), seeded mutations of valid and
fuzzed frames, raw frames (random bytes, deep nesting, huge length claims, readable headers over
garbage), multi-part frames, and now and then a frame over ``broker.max_message_bytes``. Every reply
must decode, carry the req_id the broker could read, and be of a type that answers that request; no
reply may be an ``internal`` error. Between batches a real ``BrokerClient`` rollout and learner
(the canary) register, heartbeat, lease prompts, push groups, lease batches and ack them, and read
the status. The broker's RSS is read after each batch.

``test_fuzz_10k`` (10,000+ frames, ~40 s here) runs in ``make test``; ``test_fuzz_100k`` is its
``slow`` variant. Both are derandomized, so CI sees the same frames every run.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter, defaultdict

import psutil
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.common import messages as m
from tests.broker import fuzz_strategies as fs
from tests.helpers import BrokerProcess, make_group, write_job

MAX_BYTES = 256 << 10  # broker.max_message_bytes: frames over it get `too_large`; over twice it, ZeroMQ drops them
TRANSPORT_LIMIT = 2 * MAX_BYTES  # the broker's ZMQ_MAXMSGSIZE: a longer frame closes the connection, unanswered
RSS_SLACK = 64 << 20

PERMISSION = ("unauthorized", "unregistered")  # wrong role for the request, or a client id that never registered
ANSWERS = {  # request type -> reply types (and error codes) that may answer it
    m.Register: (m.Registered, "protocol_mismatch", "too_large", "unavailable"),
    m.Heartbeat: (m.Ack, "too_large"),
    m.LeasePrompts: (m.PromptLease, m.Throttle, "bad_request", "data_exhausted"),
    m.PushGroup: (m.Ack, m.Throttle, "invalid_group"),
    m.PushGroups: (m.GroupAcks, "too_large"),
    m.ReturnPrompts: (m.Ack,),
    m.LeaseBatch: (m.BatchLease, m.Throttle, "bad_request"),
    m.AckBatch: (m.Ack,),
    m.Commit: (m.Ack,),
    m.Rewind: (m.Ack, "bad_request"),
    m.PublishVersion: (m.Ack, "bad_request"),
    m.Control: (m.Ack, "bad_request"),
    m.GetStatus: (m.Status,),
    m.GetVersion: (m.CurrentVersion,),
    m.Leave: (m.Ack,),
}
ANSWERS = {k: v + PERMISSION for k, v in ANSWERS.items()}
REFUSALS = {"bad_frame", "invalid_group", "too_large"}


def fuzz_job(tmp_path, arith_data, **broker):
    return write_job(
        tmp_path,
        arith_data,
        learner={"groups_per_step": 4},
        broker={
            "max_message_bytes": MAX_BYTES,
            "vocab_size": fs.VOCAB,
            "queue_capacity": 4096,
            "prompt_lease_s": 2.0,
            "batch_lease_s": 2.0,
            "client_timeout_s": 5.0,
            "heartbeat_s": 1.0,
            **broker,
        },
    )


@pytest.fixture(scope="module")
def broker(tmp_path_factory, arith_data):
    tmp = tmp_path_factory.mktemp("fuzz")
    proc = BrokerProcess(fuzz_job(tmp, arith_data), tmp / "run", "telemetry.log_level=WARNING").start()
    yield proc
    assert proc.stop() == 0  # SIGTERM after the fuzz: a clean exit


class Expectation:
    """What the broker may answer to one frame, worked out with the same decoder it uses."""

    def __init__(self, frame: bytes | list[bytes]):
        self.frame, self.request, self.deferred = frame, None, False
        if isinstance(frame, list):  # multi-part
            self.req_id, self.refused = 0, True
            return
        header = m.peek_header(frame)
        self.req_id, self.refused = (header[1] if header else 0), True
        if len(frame) > MAX_BYTES:
            return
        try:
            self.request = m.decode_request(frame)
        except m.ProtocolError:
            return
        m.encode(self.request)  # whatever decodes must encode again (the broker re-sends groups to learners)
        self.req_id, self.refused = self.request.req_id, False
        self.deferred = isinstance(self.request, m.LeaseBatch) and self.request.wait_s > 0

    def __repr__(self) -> str:
        frame = b"|".join(self.frame) if isinstance(self.frame, list) else self.frame
        return f"<req_id {self.req_id}: {type(self.request).__name__}, {len(frame)} bytes {frame[:48].hex()}>"

    def accepts(self, reply: m.Message) -> bool:
        if self.refused:
            return isinstance(reply, m.Error) and reply.code in REFUSALS
        if isinstance(reply, m.Error) and reply.code == "bad_frame" and "RecursionError" in reply.reason:
            return True  # nested ~1,000 deep: the decoder's depth limit counts the caller's stack, deeper in the broker
        allowed = ANSWERS[type(self.request)]
        return (
            reply.code in allowed
            if isinstance(reply, m.Error)
            else isinstance(reply, tuple(t for t in allowed if isinstance(t, type)))
        )


def matched(replies: list[m.Message], sent: list[Expectation]) -> bool:
    """Whether each reply can be paired with a different frame it answers (frames may share a req_id:
    mutations keep the header, and fuzzed ids repeat). Kuhn's augmenting paths; the groups are small."""
    owner: list[int | None] = [None] * len(sent)

    def place(i: int, seen: set[int]) -> bool:
        for j, e in enumerate(sent):
            if j not in seen and e.accepts(replies[i]):
                seen.add(j)
                if owner[j] is None or place(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(place(i, set()) for i in range(len(replies)))


class Fuzzer:
    """A raw DEALER socket, the canary clients, and the tallies of one fuzz run."""

    def __init__(self, broker: BrokerProcess):
        self.broker = broker
        self.ctx = zmq.Context()
        self.sock = self.new_socket()
        self.rollout = ZmqBrokerClient(broker.address, "canary-r", "rollout", timeout_s=10.0)
        self.learner = ZmqBrokerClient(broker.address, "canary-l", "learner", timeout_s=10.0)
        self.operator = ZmqBrokerClient(broker.address, "canary-o", "operator", timeout_s=10.0)
        for c in (self.rollout, self.learner, self.operator):
            c.connect()
        self.proc = psutil.Process(broker.proc.pid)
        self.tally: Counter[str] = Counter()
        self.rss: list[int] = []
        self.valid = fs.valid_frames()
        self.leases: list[m.PromptLease | m.BatchLease] = []  # leases the fuzz got: its next batch acts on them
        self.register_pool()

    def register_pool(self) -> None:
        """The fuzz's own client ids start registered with a fitting role (fuzzed Registers change them later)."""
        roles = {"fz-r0": "rollout", "fz-r1": "rollout", "fz-l0": "learner", "fz-l1": "learner", "fz-mon": "operator"}
        for i, (cid, role) in enumerate(roles.items()):
            self.sock.send(m.encode(m.Register(req_id=2**50 + i, client_id=cid, role=role)))
        for _ in roles:
            assert self.sock.poll(5000) and isinstance(m.decode_reply(self.sock.recv()), m.Registered)

    def new_socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.broker.address)
        return sock

    def close(self) -> None:
        for c in (self.rollout, self.learner, self.operator):
            c.close()
        self.sock.close()
        self.ctx.term()

    def frames(self, requests: list[list], rng: random.Random) -> list[bytes | list[bytes]]:
        rng = random.Random(rng.getrandbits(64))  # hypothesis' own Random draws every byte through its engine: slow
        structured = [fs.encode_raw(r) for r in requests]
        seeds = structured + self.valid
        out: list[bytes | list[bytes]] = list(structured)
        out += [fs.mutate(rng.choice(seeds), rng, seeds) for _ in range(2 * len(structured))]
        out += [fs.raw_frame(rng, seeds, fs.REQUEST_TAGS) for _ in range(len(structured) // 2)]
        if rng.random() < 0.3:
            out.append(
                rng.choice(
                    [[b"", rng.choice(seeds)], [rng.choice(seeds), b""], [b"a", b"b", b"c"], [rng.choice(seeds)] * 2]
                )
            )
        if rng.random() < 0.05:  # over max_message_bytes, under the transport's 2x limit: a typed too_large
            out.append(rng.choice(seeds) + rng.randbytes(MAX_BYTES + rng.randrange(MAX_BYTES // 2)))
        out += [self.follow_up(lease, rng) for lease in self.leases]
        self.leases.clear()
        rng.shuffle(out)
        out = [f if isinstance(f, list) else f[: TRANSPORT_LIMIT - 1] for f in out]
        return [f for f in out if not self.long_poll(f)]

    def long_poll(self, frame: bytes | list[bytes]) -> bool:
        """A LeaseBatch the broker may hold for long (up to MAX_WAIT_S): left to test_unbounded_long_polls_are_answered."""
        if isinstance(frame, list) or len(frame) > MAX_BYTES:
            return False
        try:
            req = m.decode_request(frame)
        except m.ProtocolError:
            return False
        if isinstance(req, m.LeaseBatch) and req.wait_s > 0.3:
            self.tally["long_polls_left_out"] += 1
            return True
        return False

    @staticmethod
    def follow_up(lease: m.PromptLease | m.BatchLease, rng: random.Random) -> bytes:
        """A request on a lease the broker granted (real lease and prompt/group ids), fuzzed around the edges."""
        cid = rng.choice(fs.CLIENT_POOL)
        if isinstance(lease, m.PromptLease):
            ids = [p.prompt_id for p in lease.prompts]
            if rng.random() < 0.5:
                return m.encode(
                    m.ReturnPrompts(
                        req_id=rng.randrange(1, 2**40),
                        client_id=cid,
                        lease_id=lease.lease_id,
                        prompt_ids=rng.sample(ids, rng.randint(0, len(ids))) + ["0:0"] * rng.randint(0, 1),
                    )
                )
            g = make_group(rng.choice(ids), version=max(0, lease.policy_version), token=rng.choice([5, 262, 263, -1]))
            return (
                fs.mutate(m.encode(m.PushGroup(req_id=rng.randrange(1, 2**40), client_id=cid, group=g)), rng)
                if rng.random() < 0.2
                else m.encode(m.PushGroup(req_id=rng.randrange(1, 2**40), client_id=cid, group=g))
            )
        gids = [g.group_id for g in lease.groups]
        kind = rng.randrange(4)
        if kind == 2:
            return m.encode(m.Rewind(req_id=rng.randrange(1, 2**40), client_id=cid, step=rng.randint(-1, 3)))
        if kind == 3:
            return m.encode(m.Commit(req_id=rng.randrange(1, 2**40), client_id=cid, step=rng.randint(-1, 3)))
        return m.encode(
            m.AckBatch(
                req_id=rng.randrange(1, 2**40),
                client_id=cid,
                lease_id=lease.lease_id,
                step=rng.randint(0, 3),
                group_ids=rng.sample(gids, rng.randint(0, len(gids))) + ["nope"] * rng.randint(0, 1),
                keep_rest=rng.random() < 0.5,
            )
        )

    def send_batch(self, frames: list[bytes | list[bytes]]) -> None:
        expected: dict[int, list[Expectation]] = defaultdict(list)
        longest = 0.0
        for f in frames:
            e = Expectation(f)
            expected[e.req_id].append(e)
            if e.deferred:
                longest = max(longest, e.request.wait_s)
            (self.sock.send_multipart if isinstance(f, list) else self.sock.send)(f)
        self.tally["frames"] += len(frames)
        self.tally["decodable"] += sum(not e.refused for es in expected.values() for e in es)
        replies: dict[int, list[m.Message]] = defaultdict(list)
        received, t0 = 0, time.monotonic()
        deadline = t0 + 10.0 + longest  # generous: CI machines may be busy
        while received < len(frames) and time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            reply = m.decode_reply(self.sock.recv())  # raises (failing the test) on anything but a Reply
            replies[reply.req_id].append(reply)
            received += 1
            if isinstance(reply, (m.PromptLease, m.BatchLease)):
                self.leases.append(reply)
            self.tally[f"reply:{type(reply).__name__}" + (f":{reply.code}" if isinstance(reply, m.Error) else "")] += 1
        self.tally["reply_wait_ms"] += int(1000 * (time.monotonic() - t0))
        for req_id, got in replies.items():
            assert matched(got, expected.get(req_id, [])), (
                f"replies {got} do not answer the frames sent with req_id {req_id}: {expected.get(req_id)}"
            )
        assert received == len(frames), (
            f"{len(frames) - received} of {len(frames)} frames got no reply: {dict(expected)}"
        )
        assert self.broker.proc.poll() is None, "the broker died"
        self.rss.append(self.proc.memory_info().rss)

    def canary(self) -> None:
        """A well-behaved rollout and learner: every call answered correctly, groups accepted and trained."""
        r, lrn = self.rollout, self.learner
        version = r.current_version()
        assert isinstance(version, m.CurrentVersion)
        v = max(0, version.version)
        assert isinstance(r.heartbeat(v, {"tokens_per_s": 1.0}), m.Ack)
        if version.paused:
            assert self.operator.control("resume").ref == "resume"
        lease = r.lease_prompts(2, v)
        if isinstance(lease, m.PromptLease):
            assert 1 <= len(lease.prompts) <= 2
            groups = [make_group(p.prompt_id, version=v) for p in lease.prompts]
            acks = r.push_groups(groups)
            assert [a.group_id for a in acks] == [g.group_id for g in groups]
            for a in acks:  # stale: the fuzz published a newer version or discarded (rolled back) this one
                assert a.status in ("accepted", "stale"), a
                self.tally[f"canary_{a.status}"] += 1
            self.tally["canary_leases"] += 1
        else:
            assert isinstance(lease, m.Throttle) and lease.retry_after_s > 0, lease
            self.tally["canary_throttled"] += 1
        batch = lrn.lease_batch(1)  # fewer than it pushed: the rest of the queue is left to the fuzz's own leases
        if isinstance(batch, m.BatchLease):
            assert all(
                m.check_group(g, fs.VOCAB) is None for g in batch.groups
            )  # nothing invalid ever reaches a learner
            assert lrn.ack_batch(batch.lease_id, [g.group_id for g in batch.groups], 1).count == len(batch.groups)
            self.tally["canary_trained"] += len(batch.groups)
        status = r.status()
        assert status.rejected.get("internal", 0) == 0, status.rejected
        self.tally["canary_rounds"] += 1


def run_fuzz(broker: BrokerProcess, examples: int, requests: st.SearchStrategy | None = None) -> Counter:
    fuzzer = Fuzzer(broker)

    # no shrinking: every shrink step would replay batches against the live broker (with its timeouts);
    # a failure prints the frames of the batch instead
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(
        requests=requests if requests is not None else st.lists(fs.request_array(), min_size=6, max_size=10),
        rng=st.randoms(use_true_random=False),
    )
    def batch(requests, rng):
        try:
            fuzzer.send_batch(fuzzer.frames(requests, rng))
        except AssertionError:  # hypothesis replays a failing batch: on a fresh socket, without this one's leftovers
            fuzzer.sock.close()
            fuzzer.sock = fuzzer.new_socket()
            raise
        fuzzer.canary()

    try:
        batch()
        fuzzer.canary()
        warm = fuzzer.rss[len(fuzzer.rss) // 10]
        assert max(fuzzer.rss) < 2 * warm + RSS_SLACK, (
            f"broker RSS grew from {warm >> 20} MiB to {max(fuzzer.rss) >> 20} MiB"
        )
        fuzzer.tally["rss_warm_mib"], fuzzer.tally["rss_max_mib"] = warm >> 20, max(fuzzer.rss) >> 20
    finally:
        fuzzer.close()
    return fuzzer.tally


def test_fuzz_10k(broker):
    tally = run_fuzz(broker, examples=410)
    print(dict(tally))
    assert tally["frames"] >= 10_000
    assert tally["decodable"] >= 1_500  # the handlers were reached, not only the decoder
    assert tally["canary_leases"] >= tally["canary_rounds"] // 3
    assert tally["canary_accepted"] > 0 and tally["canary_trained"] > 0


@pytest.mark.slow
def test_fuzz_100k(tmp_path, arith_data):
    proc = BrokerProcess(fuzz_job(tmp_path, arith_data), tmp_path / "run", "telemetry.log_level=WARNING").start()
    try:
        tally = run_fuzz(proc, examples=3900)
        assert tally["frames"] >= 100_000
    finally:
        assert proc.stop() == 0


def test_fuzz_stop_and_discard(tmp_path, arith_data):
    """Controls that change the broker for good (stop; discard of random version ranges), among pushes,
    leases and acks, on a broker of their own: still every frame answered and the canary served."""
    proc = BrokerProcess(fuzz_job(tmp_path, arith_data), tmp_path / "run", "telemetry.log_level=WARNING").start()
    try:
        mix = st.lists(st.one_of(fs.control_array(), fs.request_array((4, 14, 6, 7, 10, 3))), min_size=4, max_size=8)
        tally = run_fuzz(proc, examples=100, requests=mix)
        assert tally["frames"] >= 1_500 and tally["canary_rounds"] == 101
        with (
            ZmqBrokerClient(proc.address, "op", "operator", timeout_s=5.0) as c,
            ZmqBrokerClient(proc.address, "late-r", "rollout", timeout_s=5.0) as r,
        ):
            c.connect()
            r.connect()
            assert c.control("stop", reason="fuzz").ref == "stop"
            lease = r.lease_prompts(4, max(0, r.current_version().version))
            assert isinstance(lease, m.Throttle) and lease.reason == "stopping"  # for good
            assert isinstance(c.status(), m.Status) and isinstance(c.current_version(), m.CurrentVersion)
    finally:
        assert proc.stop() == 0


def raw_roundtrip(address: str, frames: list[bytes], timeout: float) -> tuple[list[m.Message], float]:
    """Send every frame on one DEALER; the replies that came within ``timeout`` s and when the last did."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    t0 = time.monotonic()
    try:
        for f in frames:
            sock.send(f)
        replies, last = [], 0.0
        while len(replies) < len(frames) and time.monotonic() - t0 < timeout:
            if sock.poll(100):
                replies.append(m.decode_reply(sock.recv()))
                last = time.monotonic() - t0
        return replies, last
    finally:
        sock.close()
        ctx.term()


def long_polls(waits, n: int = 2**63 - 1, min_groups: int = 2**63 - 1) -> list[bytes]:
    """A learner's Register, then one LeaseBatch per wait."""
    return [m.encode(m.Register(req_id=10**6, client_id="fz-poll", role="learner"))] + [
        m.encode(m.LeaseBatch(req_id=i + 1, client_id="fz-poll", n=n, wait_s=w, min_groups=min_groups))
        for i, w in enumerate(waits)
    ]


def test_long_polls_end(broker):
    """NaN, negative and -inf waits are answered at once; an infinite one still wakes when groups arrive."""
    replies, last = raw_roundtrip(broker.address, long_polls([math.nan, -math.inf, -1.0, -0.0, 0.0] * 20), timeout=5.0)
    assert len(replies) == 101 and last < 2.0 and isinstance(replies[0], m.Registered)
    assert all(isinstance(r, (m.Throttle, m.BatchLease)) for r in replies[1:])
    with ZmqBrokerClient(broker.address, "poll-pusher", "rollout", timeout_s=5.0) as c:
        c.connect()
        v = max(0, c.current_version().version)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(broker.address)
        try:
            register, poll = long_polls([math.inf], n=1, min_groups=1)
            sock.send(register)
            assert sock.poll(3000) and isinstance(m.decode_reply(sock.recv()), m.Registered)
            sock.send(poll)
            assert not sock.poll(300)  # held
            lease = c.lease_prompts(1, v)
            c.push_groups([make_group(lease.prompts[0].prompt_id, version=v)])
            assert sock.poll(3000)
            assert isinstance(m.decode_reply(sock.recv()), (m.BatchLease, m.Throttle))
        finally:
            sock.close()
            ctx.term()


@pytest.mark.slow
def test_unbounded_long_polls_are_answered(broker):
    """A LeaseBatch is held at most server.MAX_WAIT_S (60 s), whatever its wait_s: no request waits for ever."""
    from fleetrl.broker.server.service import MAX_WAIT_S

    replies, last = raw_roundtrip(
        broker.address, long_polls([math.inf, 1e300, 1e9, MAX_WAIT_S + 30] * 50), timeout=MAX_WAIT_S + 10
    )
    assert len(replies) == 201 and MAX_WAIT_S - 1 < last < MAX_WAIT_S + 5


def test_return_prompts_with_a_repeated_id(broker):
    """Found by this fuzz: a ReturnPrompts naming one prompt twice raised KeyError inside the broker
    (an `internal` error, after half the prompts had been put back)."""
    with (
        ZmqBrokerClient(broker.address, "repeat", "rollout", timeout_s=5.0) as c,
        ZmqBrokerClient(broker.address, "repeat-op", "operator", timeout_s=5.0) as op,
    ):
        c.connect()
        op.connect()
        op.control("resume")
        v = max(0, c.current_version().version)
        lease = c.lease_prompts(2, v)
        assert isinstance(lease, m.PromptLease)
        first = lease.prompts[0].prompt_id
        assert c.return_prompts(lease.lease_id, [first, first, "0:-1"]).count == 1
        assert c.status().rejected.get("internal", 0) == 0
        assert c.return_prompts(lease.lease_id).count == len(lease.prompts) - 1


def test_oversized_frames_are_dropped_by_the_transport(broker):
    """Over 2x max_message_bytes ZeroMQ drops the frame (and that connection); the broker serves on."""
    replies, _ = raw_roundtrip(
        broker.address, [m.encode(m.GetStatus(req_id=5)) + b"\x00" * TRANSPORT_LIMIT], timeout=1.0
    )
    assert replies == []  # dropped, unanswered
    replies, _ = raw_roundtrip(broker.address, [m.encode(m.GetStatus(req_id=6)) + b"\x00" * MAX_BYTES], timeout=5.0)
    assert replies[0].req_id == 6 and replies[0].code == "too_large"  # under the transport limit: a typed refusal
    with ZmqBrokerClient(broker.address, "after-oversize", "monitor", timeout_s=5.0) as c:
        c.connect()
        assert isinstance(c.status(), m.Status)
    assert broker.proc.poll() is None
