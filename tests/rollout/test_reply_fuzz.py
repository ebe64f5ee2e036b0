"""Fuzzing the client side of the wire: how rollout servers and learners (both through
``fleetrl.broker.client.sync``) decode what the broker sends them.

- The decoders raise ``ProtocolError`` and nothing else, for replies and announcements of every type
  with random fields, raw and mutated frames, and deep nesting; what they accept encodes again.
- ``AsyncBrokerClient._on_replies`` and ``AsyncSubscription._on_batch`` skip bad frames, count them,
  and still resolve the request that is waiting (deliver the announcement that is valid).
- Over real sockets: a fake broker answers every request of a real ``BrokerClient`` with a burst of
  garbage before the real reply, and its PUB socket sends garbage between announcements.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.broker.client.aio import AsyncBrokerClient
from fleetrl.broker.client.sync import AsyncSubscription, ZmqBrokerClient
from fleetrl.common import messages as m
from tests.broker import fuzz_strategies as fs

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
VALID_REPLIES = fs.valid_replies()
VALID_REQUESTS = fs.valid_frames()
PENDING = 424242  # the req_id a test keeps waiting; no fuzzed frame may carry it


def frames_from(structured: list[list], rng: random.Random, n_mutated: int = 3) -> list[bytes]:
    """Encoded structures, mutations of them and of valid replies, and raw frames."""
    rng = random.Random(rng.getrandbits(64))
    encoded = [fs.encode_raw(s) for s in structured]
    seeds = encoded + VALID_REPLIES
    out = encoded + [fs.mutate(rng.choice(seeds), rng, seeds) for _ in range(n_mutated * len(encoded))]
    out += [fs.raw_frame(rng, seeds, [20, 21, 22, 23, 24, 25, 26, 27, 28, 40, 41]) for _ in range(len(encoded))]
    return out


def decode_or_none(decode, frame: bytes):
    """The decoded message, or None for a ProtocolError; anything else raised fails the test."""
    try:
        msg = decode(frame)
    except m.ProtocolError as e:
        assert e.reason
        return None
    m.encode(msg)  # whatever decodes encodes again
    return msg


@SETTINGS
@given(
    st.lists(st.one_of(fs.reply_array(), fs.announcement_array(), fs.request_array()), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
)
def test_decoders_raise_only_protocol_error(structured, rng):
    for frame in frames_from(structured, rng) + [b"", b"\xc1"]:
        reply = decode_or_none(m.decode_reply, frame)
        assert reply is None or isinstance(reply, m.Reply.__args__)
        ann = decode_or_none(m.decode_announcement, frame)
        assert ann is None or isinstance(ann, m.Announcement.__args__)
        decode_or_none(m.decode_request, frame)
        decode_or_none(m.decode_group, frame)
        header = m.peek_header(frame)
        assert header is None or all(isinstance(v, int) and v >= 0 for v in header)


def not_pending(frame: bytes) -> bool:
    reply = decode_or_none(m.decode_reply, frame)
    return reply is None or reply.req_id != PENDING


@SETTINGS
@given(st.lists(fs.reply_array(), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_client_skips_bad_replies_and_resolves_the_pending_request(structured, rng):
    client = AsyncBrokerClient("tcp://127.0.0.1:9", "fuzz-client", "rollout")  # never connected: replies are fed in
    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
        client._pending[PENDING] = fut
        frames = [f for f in frames_from(structured, rng) if not_pending(f)]
        batch = [[f] for f in frames] + [[b"", f] for f in frames[:2]]  # DEALER hands over [payload] (or more parts)
        client._on_replies(batch)
        assert not fut.done()
        bad = sum(decode_or_none(m.decode_reply, f) is None for f in frames)
        assert client.bad_replies == bad + sum(decode_or_none(m.decode_reply, f) is None for f in frames[:2])
        good = m.Status(
            req_id=PENDING,
            broker_id="b",
            uptime_s=1.0,
            policy_version=2,
            queue_depth=0,
            groups_in_flight=0,
            prompts_leased=0,
            groups_in=0,
            groups_out=0,
            groups_in_per_s=0.0,
            groups_out_per_s=0.0,
            dropped_stale=0,
            duplicates=0,
        )
        client._on_replies([[m.encode(good)]])
        assert fut.result() == good and PENDING not in client._pending
    finally:
        loop.close()


@SETTINGS
@given(st.lists(fs.announcement_array(), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_subscription_skips_bad_announcements(structured, rng):
    frames = frames_from(structured, rng)
    decoded = [decode_or_none(m.decode_announcement, f) for f in frames]

    async def feed() -> tuple[list, int]:
        ctx = zmq.Context.instance()
        sub = AsyncSubscription(ctx.socket(zmq.SUB))  # not connected: batches are fed in as PUB delivers them
        try:
            sub._on_batch([[m.TOPIC_VERSION, f] for f in frames])
            sub._on_batch([[m.TOPIC_VERSION, m.encode(m.VersionAnnouncement(version=7))]])
            got = []
            while (ann := await sub.next(0)) is not None:
                got.append(ann)
            return got, sub.bad
        finally:
            sub.close()

    got, bad = asyncio.run(feed())
    valid = [d for d in decoded if d is not None]
    assert bad == len(frames) - len(valid)
    assert len(got) == len(valid) + 1 and got[-1] == m.VersionAnnouncement(version=7)


# ----------------------------------------------------------------------------- real sockets


class GarbageBroker:
    """A fake broker: answers each request with ``burst`` garbage frames, then the right reply;
    its PUB socket sends garbage and a version announcement until stopped."""

    def __init__(self, burst: int, seed: int = 0):
        self.ctx = zmq.Context()
        self.router, self.pub = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.PUB)
        for s in (self.router, self.pub):
            s.linger = 0
        self.router.bind("tcp://127.0.0.1:*")
        self.pub.bind("tcp://127.0.0.1:*")
        self.address = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pub_port = int(self.pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.burst, self.rng = burst, random.Random(seed)
        self.garbage_sent = self.undecodable_sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def garbage(self, avoid: int, n: int) -> list[bytes]:
        seeds = VALID_REPLIES
        out = []
        while len(out) < n:
            f = (
                fs.mutate(self.rng.choice(seeds), self.rng, seeds)
                if self.rng.random() < 0.7
                else fs.raw_frame(self.rng, seeds, [20, 21, 23, 25, 27, 28])
            )
            reply = decode_or_none(m.decode_reply, f)
            if reply is None or reply.req_id != avoid:
                out.append(f)
        return out

    def answer(self, req: m.Message) -> m.Message:
        if isinstance(req, m.Register):
            return m.Registered(
                req_id=req.req_id, broker_id="garbage", pub_port=self.pub_port, max_message_bytes=1 << 20
            )
        if isinstance(req, m.LeaseBatch):
            return m.Throttle(req_id=req.req_id, retry_after_s=0.1, reason="no fresh groups queued yet")
        if isinstance(req, m.GetVersion):
            return m.CurrentVersion(req_id=req.req_id, version=3)
        return m.Ack(req_id=req.req_id, ref="ok", count=1)

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self.stop.is_set():
            # garbage that happens to decode as an announcement is a valid one: only the undecodable kind goes out
            noise = [f for f in self.garbage(-1, 20) if decode_or_none(m.decode_announcement, f) is None]
            for f in noise + [m.encode(m.VersionAnnouncement(version=9))]:
                self.pub.send_multipart([m.TOPIC_VERSION, f])
            if not poller.poll(50):
                continue
            ident, payload = self.router.recv_multipart()
            req = m.decode_request(payload)
            burst = self.garbage(req.req_id, self.burst)
            self.garbage_sent += len(burst)
            self.undecodable_sent += sum(decode_or_none(m.decode_reply, f) is None for f in burst)
            for f in burst:
                self.router.send_multipart([ident, f])
            self.router.send_multipart(
                [ident, b"extra part", m.encode(self.answer(req))]
            )  # parts before the payload too

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.router.close()
        self.pub.close()
        self.ctx.term()


def test_real_client_survives_garbage_from_the_broker():
    """The BrokerClient of rollout servers and learners, on real sockets, under 2,000+ bad frames."""
    fake = GarbageBroker(burst=300)
    try:
        with ZmqBrokerClient(fake.address, "fuzz-rollout", "rollout", timeout_s=10.0) as c:
            reg = c.connect()
            assert reg.broker_id == "garbage"
            assert c.heartbeat(1).ref == "ok"
            assert c.current_version().version == 3
            assert isinstance(c.lease_batch(4, wait_s=0.0), m.Throttle)
            assert c.return_prompts("L", ["0:1"]).count == 1
            for _ in range(3):
                assert c.heartbeat(2).count == 1
            sub = c.subscribe()
            deadline = time.monotonic() + 10
            ann = None
            while ann is None and time.monotonic() < deadline:
                ann = sub.next(timeout_s=0.5)
            assert ann == m.VersionAnnouncement(version=9)
            assert c.client.bad_replies == fake.undecodable_sent and fake.garbage_sent >= 2_000
            assert c._subs[0].bad > 0  # garbage announcements were skipped, and counted
    finally:
        fake.close()


def test_undecodable_replies_are_logged_not_raised(caplog):
    client = AsyncBrokerClient("tcp://127.0.0.1:9", "fuzz-client", "learner")
    client._on_replies([[b"\x93\x14"], [msgspec.msgpack.encode([25, 1, "L", [["g"]], 1.0])]])
    assert client.bad_replies == 2 and "undecodable reply" in caplog.text
