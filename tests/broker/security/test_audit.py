"""Issue 31: the audit log could be flooded (5,175 lines in 11 s from unlisted keys), bloated (a 4 MiB
client id made each refusal a 4 MiB line), lost (a torn tail swallowed the next record), turned against
the broker (a symlinked audit.jsonl was followed and its target chmod-ed) or stop start-up with a
traceback (a directory in its place)."""

from __future__ import annotations

import json
import os

import pytest

from fleetrl.app import cli
from fleetrl.broker.security import audit as au
from fleetrl.broker.security.audit import AuditLog, AuditLogError
from tests.helpers import write_job


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_flooding_peer_is_rate_limited_with_one_summary_per_window(tmp_path):
    now = [0.0]
    log = AuditLog(tmp_path / "audit.jsonl", clock=lambda: now[0])
    for i in range(5000):
        log({"event": "refused", "identity": "flooder", "n": i})
        if i % 100 == 0:
            log({"event": "refused", "identity": "honest", "n": i})
    now[0] = au.WINDOW_S + 1
    log({"event": "refused", "identity": "flooder", "n": -1})
    log.close()
    got = rows(tmp_path / "audit.jsonl")
    flooder = [r for r in got if r.get("identity") == "flooder"]
    assert len(flooder) == au.PEER_LINES + 1 and len([r for r in got if r.get("identity") == "honest"]) == 50
    [summary] = [r for r in got if r["event"] == "audit_suppressed"]
    assert summary["peer"] == "flooder" and summary["suppressed"] == 5000 - au.PEER_LINES
    assert got.index(summary) == len(got) - 2  # written once, just before the flooder's next line
    assert log.suppressed == 5000 - au.PEER_LINES


def test_fields_are_truncated(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl")
    log({"event": "refused", "client_id": "x" * (4 << 20), "reason": {"deep": list(range(10_000))}})
    log.close()
    text = (tmp_path / "audit.jsonl").read_text()
    assert len(text) < 4096
    assert f"(+{(4 << 20) - au.MAX_FIELD_CHARS} chars)" in text and "+9936 items" in text


def test_a_symlink_is_never_followed_and_a_directory_is_one_clear_error(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("someone else's file\n")
    os.chmod(target, 0o644)
    link = tmp_path / "audit.jsonl"
    link.symlink_to(target)
    with pytest.raises(AuditLogError, match="is a symlink.*broker.audit_log"):
        AuditLog(link)
    assert target.stat().st_mode & 0o777 == 0o644 and target.read_text() == "someone else's file\n"
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(AuditLogError, match="is a directory"):
        AuditLog(tmp_path / "dir.jsonl")


def test_a_torn_tail_is_closed_off_at_start_up(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text('{"event": "Control", "identity": "op"}\n{"event": "Contr')  # the broker died mid-write
    log = AuditLog(path)
    log({"event": "Commit", "identity": "learner"})
    log.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"event": "Contr' and json.loads(lines[2])["event"] == "Commit"


def test_the_broker_refuses_to_start_on_a_bad_audit_log_in_one_line(tmp_path, arith_data, capsys):
    (tmp_path / "audit-dir").mkdir()
    job = write_job(tmp_path, arith_data, broker={"audit_log": str(tmp_path / "audit-dir")})
    umask = os.umask(0o077)  # cli.main sets the process umask: put it back after
    try:
        assert cli.main(["broker", "--config", str(job), "--run-dir", str(tmp_path / "run")]) == 2
    finally:
        os.umask(umask)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a directory" in err and "broker.audit_log" in err


def test_authorized_events_are_never_rate_limited(tmp_path):
    log = AuditLog(tmp_path / "audit.jsonl", clock=lambda: 0.0)
    for v in range(3 * au.PEER_LINES):
        log({"event": "PublishVersion", "identity": "learner", "version": v})
    log.close()
    assert len(rows(tmp_path / "audit.jsonl")) == 3 * au.PEER_LINES
