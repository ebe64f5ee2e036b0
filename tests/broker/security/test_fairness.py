"""Per-key fairness (issue 31, item 5 of its list), on the state machine with the keys' principals:

- a monitor key filled the 4,096-client table: a real rollout and a restarted learner got `unavailable` 10 of
  10 times over 75 s;
- a rollout key leased all 48 prompts and re-leased them, throttling the real rollout;
- a key that floods is throttled, and the throttling is audited once per window.
(Per-prompt acceptance, group_size samples per hand-out, is test_discard.py's.)
"""

from __future__ import annotations

from fleetrl.broker.security.auth import Principal
from fleetrl.common import messages as m
from tests.broker.conftest import make_state

MONITOR, GPU_A, GPU_B = Principal("grafana", "monitor"), Principal("gpu-a", "rollout"), Principal("gpu-b", "rollout")
LEARNER = Principal("learner", "learner")


def register(state, principal, client_id, role=None, now=0.0):
    return state.handle(m.Register(req_id=1, client_id=client_id, role=role or principal.role), now, principal)


def test_a_monitor_key_cannot_crowd_fleet_roles_out_of_the_client_table():
    state = make_state("broker.max_clients=64", "broker.max_monitor_clients=64", "broker.key_requests_per_s=100000")
    assert isinstance(register(state, LEARNER, "learner-0", now=0.0), m.Registered)
    for i in range(500):  # the flood: live monitors, each seen just now
        reply = register(state, MONITOR, f"grafana-{i}", now=1.0 + i * 1e-3)
        assert isinstance(reply, m.Registered), reply
    assert len(state.clients) == 64 and len(state.clients.monitors) == 63  # the learner's record stayed
    # a real rollout and the learner after a restart still register, though every record is alive
    assert isinstance(register(state, GPU_A, "gpu-a-0-host-1", now=2.0), m.Registered)
    assert isinstance(register(state, LEARNER, "learner-0", now=2.0), m.Registered)
    assert state.clients.get("gpu-a-0-host-1") is not None and len(state.clients) == 64
    assert len(state.clients.monitors) == 62  # the longest-silent monitor made room for the rollout


def test_monitors_are_capped_and_one_key_holds_at_most_its_share_of_the_table():
    state = make_state(
        "broker.max_clients=4096",
        "broker.max_monitor_clients=8",
        "broker.max_clients_per_key=10",
        "broker.key_requests_per_s=100000",
    )
    for i in range(20):
        assert isinstance(register(state, MONITOR, f"grafana-{i}", now=i), m.Registered)
    assert list(state.clients.monitors) == [f"grafana-{i}" for i in range(12, 20)]  # the longest-silent made room
    for i in range(10):
        assert isinstance(register(state, GPU_A, f"gpu-a-{i}", now=30.0), m.Registered)
    refused = register(state, GPU_A, "gpu-a-10", now=30.0)
    assert refused.code == "unavailable" and "broker.max_clients_per_key=10" in refused.reason
    assert isinstance(register(state, GPU_B, "gpu-b-0", now=30.0), m.Registered)  # other keys are not affected
    assert isinstance(register(state, GPU_A, "gpu-a-10", now=100.0), m.Registered)  # its own dead record made room
    assert state.clients.get("gpu-a-0") is None and len(state.clients.by_key["gpu-a"]) == 10
    assert state.rejected["too_many_clients"] == 1


def test_a_flooding_key_is_throttled_and_audited_once_per_window():
    audit: list[dict] = []
    state = make_state("broker.key_requests_per_s=100")
    state.audit = audit.append
    register(state, GPU_B, "gpu-b-0")
    replies = [state.handle(m.GetStatus(req_id=i, client_id="grafana-0"), 5.0, MONITOR) for i in range(1000)]
    refused = [r for r in replies if isinstance(r, m.Error)]
    assert len(refused) == 1000 - 200  # a burst of twice the rate, then nothing until the bucket refills
    assert all(r.code == "unavailable" and "broker.key_requests_per_s=100" in r.reason for r in refused)
    assert isinstance(state.handle(m.GetVersion(req_id=1, client_id="gpu-b-0"), 5.0, GPU_B), m.CurrentVersion)
    lines = [a for a in audit if a["event"] == "key_throttled"]
    assert len(lines) == 1 and lines[0]["key"] == "grafana" and lines[0]["refused"] == 1
    flood = [state.handle(m.GetStatus(req_id=i, client_id="grafana-0"), 9.0, MONITOR) for i in range(300)]
    assert sum(isinstance(r, m.Error) for r in flood) == 100  # refilled to its burst, then refused again...
    assert len([a for a in audit if a["event"] == "key_throttled"]) == 1  # ...and not audited again in the window
    for i in range(300):  # 10 s after the first line: one more, with what was refused since
        state.handle(m.GetStatus(req_id=i, client_id="grafana-0"), 15.5, MONITOR)
    later = [a for a in audit if a["event"] == "key_throttled"]
    assert len(later) == 2 and later[1]["refused"] == 799 + 100 + 1
    assert state.counters["key_throttled"] == 1000


def lease(state, principal, client_id, n, now):
    return state.handle(m.LeasePrompts(req_id=1, client_id=client_id, n=n), now, principal)


def test_a_key_that_holds_every_prompt_gets_its_share_once_another_waits():
    state = make_state("broker.queue_capacity=8", "broker.key_requests_per_s=100000")
    register(state, GPU_A, "gpu-a-0")
    register(state, GPU_B, "gpu-b-0")
    hog = lease(state, GPU_A, "gpu-a-0", 8, now=1.0)
    assert len(hog.prompts) == 8  # no one else waits: one key may take everything
    assert "at capacity" in lease(state, GPU_B, "gpu-b-0", 4, now=1.1).reason  # the real rollout waits
    state.handle(m.ReturnPrompts(req_id=2, client_id="gpu-a-0", lease_id=hog.lease_id), 1.2, GPU_A)
    again = lease(state, GPU_A, "gpu-a-0", 8, now=1.3)  # the hog re-leases at once...
    assert len(again.prompts) == 4  # ...and gets its share: capacity 8 // 2 keys
    assert isinstance(lease(state, GPU_A, "gpu-a-0", 8, now=1.4), m.Throttle)
    assert "broker.fair_prompt_share" in lease(state, GPU_A, "gpu-a-0", 8, now=1.4).reason
    assert len(lease(state, GPU_B, "gpu-b-0", 8, now=1.5).prompts) == 4
    assert state.prompts.held_by_key == {"gpu-a": 4, "gpu-b": 4}
    later = lease(state, GPU_A, "gpu-a-0", 8, now=20.0)  # nobody waited for 5 s: no share applies (but capacity)
    assert isinstance(later, m.Throttle) and "at capacity" in later.reason
