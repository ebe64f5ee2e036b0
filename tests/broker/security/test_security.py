"""Security over real sockets (a broker process, loopback): CURVE keys bound to roles, every row of the
permission table refused for a key of each wrong role, client ids bound to keys, the announcement
socket closed to read-only keys, the audit log, and the start-up refusals (issue 16, items 1 and 7)."""

from __future__ import annotations

import json
import os
import time

import pytest

from fleetrl.broker.client.errors import BrokerUnavailable
from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.broker.security.keys import generate
from fleetrl.broker.security.permissions import PERMISSIONS
from fleetrl.common import messages as m
from fleetrl.common.config.schema import CurveConfig
from tests.broker.security.test_permissions import ROLES, sample
from tests.helpers import BrokerProcess, write_job

WRONG = [(kind, role) for kind, allowed in PERMISSIONS.items() for role in ROLES if role not in allowed]


@pytest.fixture(scope="module")
def secured(tmp_path_factory, arith_data):
    tmp = tmp_path_factory.mktemp("curve")
    keys = tmp / "keys"
    generate(keys, {role: [role] for role in ROLES})
    curve = {
        "server_secret_key": str(keys / "server.key_secret"),
        "server_public_key": str(keys / "server.key"),
        "authorized_keys_dir": str(keys / "clients"),
    }
    job = write_job(tmp, arith_data, broker={"curve": curve, "vocab_size": 263, "spool_dir": str(tmp / "spool")})
    proc = BrokerProcess(job, tmp / "run").start()
    clients = {}
    try:
        for role in ROLES:
            cfg = CurveConfig(**curve, client_secret_key=str(keys / f"{role}.key_secret"))
            clients[role] = ZmqBrokerClient(proc.address, f"{role}-0", role, timeout_s=5.0, curve=cfg)
            clients[role].connect()
        yield proc, clients, curve, keys
    finally:
        for c in clients.values():
            c.close()
        assert proc.stop() == 0


def raw(client: ZmqBrokerClient, req: m.Message) -> m.Message:
    return client.request(
        lambda rid: type(req)(**{**{f: getattr(req, f) for f in req.__struct_fields__}, "req_id": rid}),
        raise_errors=False,
        reregister=False,
        retry_later=False,
    )


@pytest.mark.parametrize("kind, role", WRONG, ids=[f"{k.__name__}-by-{r}" for k, r in WRONG])
def test_every_row_is_refused_for_a_key_of_a_wrong_role(secured, kind, role):
    _, clients, _, _ = secured
    reply = raw(clients[role], sample(kind, f"{role}-0", role))
    assert isinstance(reply, m.Error) and reply.code == "unauthorized", reply
    assert f"this is {role} ({role})" in reply.reason


def test_keys_are_bound_to_their_identity_and_role(secured):
    proc, clients, _, _ = secured
    assert clients["learner"].registered.identity == "learner" and clients["learner"].registered.role == "learner"
    steal = raw(
        clients["rollout"], m.LeaseBatch(req_id=1, client_id="learner-0", n=4)
    )  # the rollout key as the learner
    assert steal.code == "unauthorized" and "does not belong to key 'rollout'" in steal.reason
    claim = raw(clients["rollout"], m.Register(req_id=1, client_id="rollout-1", role="learner"))
    assert claim.code == "unauthorized" and "cannot register as learner" in claim.reason
    stop = raw(clients["learner"], m.Control(req_id=1, client_id="learner-0", action="stop"))
    assert stop.code == "unauthorized" and "operator" in stop.reason
    assert raw(clients["operator"], m.Control(req_id=1, client_id="operator-0", action="pause")).ref == "pause"
    assert raw(clients["operator"], m.Control(req_id=1, client_id="operator-0", action="resume")).ref == "resume"
    status = clients["monitor"].status()
    assert status.rejected["unauthorized"] >= 3 and status.counters["refused/LeaseBatch"] >= 1


def test_read_only_keys_get_no_round_secrets(secured):
    _, clients, _, _ = secured
    monitor_sub, rollout_sub = clients["monitor"].subscribe(), clients["rollout"].subscribe()
    time.sleep(0.5)  # the subscriptions' CURVE handshakes
    weights = m.WeightsInfo(transport="gloo", secret="ab" * 16, master_addr="127.0.0.1", master_port=1)
    version = clients["learner"].current_version().version + 1
    assert clients["learner"].publish_version(version, 1, weights).ref == str(version)
    got = rollout_sub.next(timeout_s=3.0)
    assert got.version == version and got.weights.secret == "ab" * 16
    assert monitor_sub.next(timeout_s=1.0) is None  # the PUB socket refuses monitor keys
    assert clients["monitor"].current_version().weights.secret == ""  # and GetVersion leaves the secret out
    assert clients["rollout"].current_version().weights.secret == "ab" * 16


def test_audit_log_and_owner_only_files(secured, tmp_path):
    proc, clients, curve, _ = secured
    raw(clients["rollout"], m.Commit(req_id=1, client_id="rollout-0", step=10**12))
    generate(tmp_path / "other", {"rollout": ["intruder"]})
    intruder = ZmqBrokerClient(
        proc.address,
        "intruder-0",
        "rollout",
        timeout_s=2.0,
        curve=CurveConfig(**curve, client_secret_key=str(tmp_path / "other" / "intruder.key_secret")),
    )
    with pytest.raises(BrokerUnavailable):  # BrokerUnauthorized (a refused key) is one
        intruder.connect()
    time.sleep(0.3)
    audit = proc.run_dir / "audit.jsonl"
    rows = [json.loads(line) for line in audit.read_text().splitlines()]
    assert any(r["event"] == "refused" and r["request"] == "Commit" and r["identity"] == "rollout" for r in rows)
    assert any(r["event"] == "key_refused" for r in rows)
    assert any(r["event"] == "Control" and r["identity"] == "operator" for r in rows)
    assert audit.stat().st_mode & 0o777 == 0o600
    spool = proc.run_dir.parent / "spool"
    assert spool.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in spool.iterdir())


def start_fails(tmp_path, arith_data, **broker) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    job = write_job(tmp_path, arith_data, broker=broker)
    proc = BrokerProcess(job, tmp_path / "run")
    with pytest.raises(RuntimeError, match="broker did not start") as e:
        proc.start(timeout=20)
    proc.stop()
    return str(e.value)


def test_unsafe_starts_are_refused(tmp_path, arith_data):
    keys = tmp_path / "keys"
    generate(keys, {"rollout": ["rollout"]})
    base = {"server_secret_key": str(keys / "server.key_secret"), "server_public_key": str(keys / "server.key")}
    assert "authorized_keys_dir is not set" in start_fails(tmp_path / "a", arith_data, curve=base)
    assert "is not set" in start_fails(
        tmp_path / "b", arith_data, curve={**base, "authorized_keys_dir": ""}
    )  # was: any key
    missing = start_fails(tmp_path / "c", arith_data, curve={**base, "authorized_keys_dir": str(tmp_path / "nope")})
    assert "is not a directory" in missing
    (tmp_path / "empty" / "rollout").mkdir(parents=True)
    assert "holds no keys" in start_fails(
        tmp_path / "d", arith_data, curve={**base, "authorized_keys_dir": str(tmp_path / "empty")}
    )
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "client.key").write_bytes((keys / "rollout.key").read_bytes())
    assert "outside a role subdirectory" in start_fails(
        tmp_path / "e", arith_data, curve={**base, "authorized_keys_dir": str(tmp_path / "flat")}
    )
    os.chmod(keys / "server.key_secret", 0o644)
    loose = start_fails(tmp_path / "f", arith_data, curve={**base, "authorized_keys_dir": str(keys / "clients")})
    assert "readable by others" in loose and "chmod 600" in loose
    os.chmod(keys / "server.key_secret", 0o600)
    assert "insecure_bind" in start_fails(tmp_path / "g", arith_data, host="0.0.0.0")


def test_insecure_bind_is_a_warning_at_every_start(tmp_path, arith_data):
    job = write_job(tmp_path, arith_data, broker={"host": "0.0.0.0", "insecure_bind": True})
    for i in range(2):
        proc = BrokerProcess(job, tmp_path / f"run{i}").start()
        assert proc.stop() == 0
        assert "insecure_bind: serving plaintext on 0.0.0.0" in (tmp_path / f"run{i}" / "broker.log").read_text()
