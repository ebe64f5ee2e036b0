"""The permission table on the state machine: every row refused for every wrong role, client ids bound to
their key, learners' controls scoped to their rollback, and the attacks of the audit (issue 16) refused.

Requests come with a ``Principal`` here, as the server hands them over from the CURVE handshake; the
same table over real CURVE sockets is in test_security.py."""

from __future__ import annotations

import json

import pytest

from fleetrl.broker.security.auth import Principal
from fleetrl.broker.security.permissions import PERMISSIONS
from fleetrl.common import messages as m
from tests.broker.conftest import make_state
from tests.helpers import make_group

ROLES = ("rollout", "learner", "operator", "monitor")
KEY = {role: Principal(role, role) for role in ROLES}  # one key per role, identity = role name


def cid(role: str) -> str:
    return f"{role}-0"


def register(state, role: str, now: float = 0.0, client_id: str | None = None) -> m.Message:
    return state.handle(m.Register(req_id=1, client_id=client_id or cid(role), role=role), now, KEY[role])


def as_(state, role: str, req: m.Message, now: float = 0.0) -> m.Message:
    return state.handle(req, now, KEY[role])


def sample(kind: type, client_id: str, role: str = "rollout") -> m.Message:
    """A well-formed request of every type (what the right role would send)."""
    g = make_group("0:0")
    return {
        m.Register: lambda: m.Register(req_id=7, client_id=client_id, role=role),
        m.Heartbeat: lambda: m.Heartbeat(req_id=7, client_id=client_id),
        m.GetStatus: lambda: m.GetStatus(req_id=7, client_id=client_id),
        m.GetVersion: lambda: m.GetVersion(req_id=7, client_id=client_id),
        m.LeasePrompts: lambda: m.LeasePrompts(req_id=7, client_id=client_id, n=1),
        m.PushGroup: lambda: m.PushGroup(req_id=7, client_id=client_id, group=g),
        m.PushGroups: lambda: m.PushGroups(req_id=7, client_id=client_id, groups=[g]),
        m.ReturnPrompts: lambda: m.ReturnPrompts(req_id=7, client_id=client_id, lease_id="x"),
        m.LeaseBatch: lambda: m.LeaseBatch(req_id=7, client_id=client_id, n=1),
        m.AckBatch: lambda: m.AckBatch(req_id=7, client_id=client_id, lease_id="x"),
        m.Commit: lambda: m.Commit(req_id=7, client_id=client_id, step=1),
        m.Rewind: lambda: m.Rewind(req_id=7, client_id=client_id, step=1),
        m.PublishVersion: lambda: m.PublishVersion(req_id=7, client_id=client_id, version=1),
        m.Control: lambda: m.Control(req_id=7, client_id=client_id, action="stop"),
        m.Leave: lambda: m.Leave(req_id=7, client_id=client_id, reason="test"),
    }[kind]()


WRONG = [(kind, role) for kind, allowed in PERMISSIONS.items() for role in ROLES if role not in allowed]


@pytest.fixture
def audited():
    events = []
    state = make_state(spool=None)
    state.audit = events.append
    for role in ROLES:
        assert isinstance(register(state, role), m.Registered)
    return state, events


def test_the_table_covers_every_request_type():
    assert set(PERMISSIONS) == set(m.Request.__args__)


@pytest.mark.parametrize("kind, role", WRONG, ids=[f"{k.__name__}-by-{r}" for k, r in WRONG])
def test_every_row_is_refused_for_a_wrong_role(audited, kind, role):
    state, events = audited
    before = state.status(0, 0.0)
    reply = as_(state, role, sample(kind, cid(role)))
    assert isinstance(reply, m.Error) and reply.code == "unauthorized", reply
    assert "needs role" in reply.reason and " or ".join(sorted(PERMISSIONS[kind])) in reply.reason
    after = state.status(0, 0.0)
    assert (after.policy_version, after.paused, after.queue_depth, after.prompts_leased) == (
        before.policy_version,
        before.paused,
        before.queue_depth,
        before.prompts_leased,
    )  # nothing changed
    assert state.rejected["unauthorized"] == 1 and state.counters[f"refused/{kind.__name__}"] == 1
    (event,) = [e for e in events if e["event"] == "refused"]
    assert (event["identity"], event["role"], event["request"]) == (role, role, kind.__name__)


@pytest.mark.parametrize("kind", list(PERMISSIONS), ids=lambda k: k.__name__)
def test_every_row_is_served_for_its_role(audited, kind):
    state, _ = audited
    role = "operator" if kind is m.Control else sorted(PERMISSIONS[kind] - {"monitor"})[0]
    reply = as_(state, role, sample(kind, cid(role), role))
    assert not (isinstance(reply, m.Error) and reply.code in ("unauthorized", "unregistered")), reply


def test_a_key_acts_only_for_client_ids_of_its_identity(audited):
    state, _ = audited
    # a rollout key claiming the learner's client id (the audit: lease and ack away a learner's batches)
    reply = state.handle(m.LeaseBatch(req_id=1, client_id="learner-0", n=4), 0.0, KEY["rollout"])
    assert reply.code == "unauthorized" and "does not belong to key 'rollout'" in reply.reason
    assert KEY["learner"].owns("learner-0") and KEY["learner"].owns("learner") and not KEY["learner"].owns("learnerx")
    reply = state.handle(m.Register(req_id=1, client_id="rollout-9", role="learner"), 0.0, KEY["rollout"])
    assert reply.code == "unauthorized" and "cannot register as learner" in reply.reason
    assert isinstance(
        state.handle(m.Register(req_id=1, client_id="rollout-9", role="monitor"), 0.0, KEY["rollout"]), m.Registered
    )


def test_unregistered_clients_must_register(audited):
    state, _ = audited
    reply = as_(state, "rollout", m.LeasePrompts(req_id=1, client_id="rollout-new", n=1))
    assert reply.code == "unregistered" and "Register" in reply.reason
    assert isinstance(as_(state, "rollout", m.GetVersion(req_id=1, client_id="rollout-new")), m.CurrentVersion)
    register(state, "rollout", client_id="rollout-new")
    assert isinstance(as_(state, "rollout", m.LeasePrompts(req_id=1, client_id="rollout-new", n=1)), m.PromptLease)


def fill_and_train(state, n: int = 4) -> list[m.SampleGroup]:
    lease = as_(state, "rollout", m.LeasePrompts(req_id=1, client_id=cid("rollout"), n=n))
    groups = [make_group(p.prompt_id) for p in lease.prompts]
    acks = as_(state, "rollout", m.PushGroups(req_id=2, client_id=cid("rollout"), groups=groups))
    assert {a.status for a in acks.acks} == {"accepted"}
    return groups


def test_attacks_on_the_learners_state_are_refused():
    state = make_state("broker.commit_on_checkpoint=true")
    for role in ROLES:
        register(state, role)
    register(state, "learner", client_id="learner-1")
    fill_and_train(state, 6)
    batch = as_(state, "learner", m.LeaseBatch(req_id=1, client_id="learner-0", n=4))
    as_(state, "learner", m.AckBatch(req_id=1, client_id="learner-0", lease_id=batch.lease_id, step=1))
    # another learner acks learner-0's lease, or a made-up one
    other = as_(state, "learner", m.LeaseBatch(req_id=1, client_id="learner-0", n=2))
    reply = as_(state, "learner", m.AckBatch(req_id=1, client_id="learner-1", lease_id=other.lease_id, step=1))
    assert reply.code == "unauthorized" and "held by learner-0" in reply.reason
    invented = as_(
        state,
        "learner",
        m.AckBatch(req_id=1, client_id="learner-1", lease_id="feedfacefeedface", group_ids=list(state.queued)),
    )
    assert invented.count == 0 and state.counters["late_acks_refused"] == 1
    # Commit(learner-0, 10^12) from a rollout key: it released 9 groups before
    assert as_(state, "rollout", m.Commit(req_id=1, client_id="learner-0", step=10**12)).code == "unauthorized"
    # Rewind(learner-0, -1): it re-queued groups already trained
    assert as_(state, "learner", m.Rewind(req_id=1, client_id="learner-0", step=-1)).code == "bad_request"
    assert state.uncommitted["learner-0"] and len(state.uncommitted["learner-0"]) == 4


def test_versions_cannot_be_hijacked(audited):
    state, events = audited
    assert (
        as_(state, "rollout", m.PublishVersion(req_id=1, client_id=cid("rollout"), version=10**9)).code
        == "unauthorized"
    )
    assert isinstance(as_(state, "learner", m.PublishVersion(req_id=1, client_id=cid("learner"), version=3)), m.Ack)
    jump = as_(state, "learner", m.PublishVersion(req_id=1, client_id=cid("learner"), version=10**9))
    assert jump.code == "bad_request" and "max_version_jump" in jump.reason and state.version == 3
    future = m.WeightsInfo(transport="filesystem", path="/w", published_at=state.wall() + 10**6)
    reply = as_(state, "learner", m.PublishVersion(req_id=1, client_id=cid("learner"), version=4, weights=future))
    assert reply.code == "bad_request" and "future" in reply.reason and state.version == 3
    published = [e for e in events if e["event"] == "PublishVersion"]
    assert [(e["version"], e["outcome"], e["identity"]) for e in published] == [
        (3, "ok", "learner"),
        (10**9, "bad_request", "learner"),
        (4, "bad_request", "learner"),
    ]


def test_learner_controls_are_scoped_to_its_rollback(audited):
    state, _ = audited
    register(state, "learner", client_id="learner-1")
    as_(state, "learner", m.PublishVersion(req_id=1, client_id=cid("learner"), version=5))
    learner = lambda **kw: as_(state, "learner", m.Control(req_id=1, client_id=kw.pop("c", "learner-0"), **kw))  # noqa: E731
    assert learner(action="stop").code == "unauthorized"
    assert learner(action="discard", min_version=0, max_version=-1).code == "unauthorized"  # open-ended: no more
    assert learner(action="discard", min_version=3, max_version=9).code == "unauthorized"  # beyond the current one
    assert learner(action="discard", min_version=4, max_version=5).count == 0
    assert (
        learner(action="discard", min_version=6, max_version=5).count == 0
    )  # empty: a rollback to the current version
    assert state.discarded_versions == [(4, 5)]
    learner(action="pause")
    learner(action="pause", c="learner-1")
    learner(action="resume")  # lifts its own hold only
    assert state.paused
    learner(action="resume", c="learner-1")
    assert not state.paused
    learner(action="pause")
    as_(state, "operator", m.Control(req_id=1, client_id=cid("operator"), action="stop"))
    as_(state, "operator", m.Control(req_id=1, client_id=cid("operator"), action="resume"))
    assert not state.paused and not state.controls.stopping  # an operator's resume undoes stop and every hold


def test_a_dead_learners_pause_lifts_by_itself(audited):
    state, _ = audited
    as_(state, "learner", m.Control(req_id=1, client_id=cid("learner"), action="pause", reason="rollback"))
    assert state.paused
    for role in ("rollout", "operator", "monitor"):
        state.handle(m.Heartbeat(req_id=1, client_id=cid(role)), state.bcfg.client_timeout_s + 5, KEY[role])
    state.expire(state.bcfg.client_timeout_s + 5)
    assert not state.paused


def test_audit_records_controls_publishes_commits_rewinds_and_refusals(tmp_path):
    from fleetrl.broker.security.audit import AuditLog

    log = AuditLog(tmp_path / "audit.jsonl")
    state = make_state(spool=None)
    state.audit = log
    for role in ROLES:
        register(state, role)
    as_(state, "operator", m.Control(req_id=1, client_id=cid("operator"), action="pause", reason="maintenance"))
    as_(state, "learner", m.Commit(req_id=1, client_id=cid("learner"), step=3))
    as_(state, "learner", m.Rewind(req_id=1, client_id=cid("learner"), step=2))
    as_(state, "rollout", m.Control(req_id=1, client_id=cid("rollout"), action="stop"))
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("identity"), r.get("role")) for r in rows] == [
        ("Control", "operator", "operator"),
        ("Commit", "learner", "learner"),
        ("Rewind", "learner", "learner"),
        ("refused", "rollout", "rollout"),
    ]
    assert rows[0]["reason"] == "maintenance" and (tmp_path / "audit.jsonl").stat().st_mode & 0o777 == 0o600
