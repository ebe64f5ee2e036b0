"""The broker's audit log: one JSON line per security-relevant event, in ``<run dir>/audit.jsonl``.

Every ``Control``, version publish, commit and rewind, every refused request and refused CURVE key,
and the spool becoming unwritable (and writable again), each with the identity and role of the key
behind it. The file is owner-only (0600) and appended to, flushed per line; the ZAP thread writes to
it too, hence the lock.

It cannot be flooded or turned against the broker (issue 31):

- **refusals rate-limited per peer** (``refused`` and ``key_refused``: what any key, or none, can make the
  broker write; the events of authorized keys are all kept), per the record's ``identity``, else its
  ``key``, else ``client_id``: at most
  ``PEER_LINES`` lines per ``WINDOW_S``; what a peer sends beyond is counted, and its next line after
  the window (or the log's close) is preceded by one ``audit_suppressed`` summary line (peer, count,
  window);
- **fields truncated** to ``MAX_FIELD_CHARS`` (a 4 MiB client id is not a 4 MiB line);
- **never follows a symlink** (``O_NOFOLLOW``; the mode is set on the open file, not on a path);
- **a torn tail is repaired** at start-up (the last line is ended, so the next record is not swallowed);
- **start-up errors in one line**: a symlink, a directory or an unwritable path in its place is an
  `AuditLogError` naming the path and ``broker.audit_log``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from fleetrl.common.config import ConfigError

log = logging.getLogger(__name__)

MAX_FIELD_CHARS = 512  # longest string kept in a record field (the rest is replaced by a count)
PEER_LINES = 50  # lines per peer per window
WINDOW_S = 10.0
MAX_PEERS = 4096  # peers whose window is tracked (the oldest is forgotten beyond)
LIMITED = ("refused", "key_refused")  # what an outsider or a wrong-role key can make the broker write at will


class AuditLogError(ConfigError):
    """The audit log cannot be opened where it is configured."""


def truncate(value: Any, depth: int = 0) -> Any:
    """``value`` with every string cut to MAX_FIELD_CHARS and containers bounded (16 levels, 64 items)."""
    if isinstance(value, str):
        return (
            value
            if len(value) <= MAX_FIELD_CHARS
            else f"{value[:MAX_FIELD_CHARS]}...(+{len(value) - MAX_FIELD_CHARS} chars)"
        )
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if depth >= 16:
        return "...(nested too deep)"
    if isinstance(value, dict):
        items = list(value.items())
        out = {truncate(str(k), depth + 1): truncate(v, depth + 1) for k, v in items[:64]}
        if len(items) > 64:
            out["..."] = f"+{len(items) - 64} items"
        return out
    if isinstance(value, (list, tuple)):
        kept = [truncate(v, depth + 1) for v in value[:64]]
        return kept + [f"...(+{len(value) - 64} items)"] if len(value) > 64 else kept
    return value


class AuditLog:
    def __init__(self, path: str | Path, clock=time.monotonic):
        self.path = Path(path)
        self._clock = clock
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise AuditLogError(self._why(e)) from None
        try:
            os.fchmod(fd, 0o600)
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last record: end it
                os.write(fd, b"\n")
                log.warning("audit: %s ended in a torn record (the broker died mid-write); it is closed off", self.path)
        except OSError as e:
            os.close(fd)
            raise AuditLogError(self._why(e)) from None
        self._file = os.fdopen(fd, "a", buffering=1)
        self._lock = threading.Lock()
        self._peers: OrderedDict[str, list[float]] = OrderedDict()  # peer -> [window start, lines, suppressed]
        self.failed = 0
        self.suppressed = 0

    def _why(self, e: OSError) -> str:
        if e.errno == errno.ELOOP or self.path.is_symlink():
            what = "is a symlink (the audit log never follows one)"
        elif e.errno == errno.EISDIR or self.path.is_dir():
            what = "is a directory"
        else:
            what = f"cannot be opened ({e.strerror or e})"
        return f"the audit log {self.path} {what}; remove it or set broker.audit_log to a file path"

    def __call__(self, record: dict[str, Any]) -> None:
        record = truncate(record)
        peer = str(record.get("identity") or record.get("key") or record.get("client_id") or "")
        with self._lock:
            summary, keep = self._window(peer, record.get("time")) if record.get("event") in LIMITED else (None, True)
            for rec in ([summary] if summary else []) + ([record] if keep else []):
                line = json.dumps(rec, default=str)
                try:
                    self._file.write(line + "\n")
                except (OSError, ValueError) as e:  # a full disk must not stop the broker; the event is logged instead
                    self.failed += 1
                    log.warning("audit: could not write %s (%s)", line[:1000], e)

    def _window(self, peer: str, when: Any) -> tuple[dict[str, Any] | None, bool]:
        """(a summary line of what ``peer`` had suppressed in its last window, or None; whether this record
        is written). Call with the lock held."""
        now, summary = self._clock(), None
        state = self._peers.get(peer)
        if state is None or now - state[0] >= WINDOW_S:
            if state is not None and state[2]:
                summary = {
                    "time": when,
                    "event": "audit_suppressed",
                    "peer": peer,
                    "suppressed": int(state[2]),
                    "window_s": WINDOW_S,
                    "limit": PEER_LINES,
                }
            state = self._peers[peer] = [now, 0, 0]
        self._peers.move_to_end(peer)
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)
        if state[1] < PEER_LINES:
            state[1] += 1
            return summary, True
        state[2] += 1
        self.suppressed += 1
        return summary, False

    def close(self) -> None:
        with self._lock:
            try:
                for peer, (_, _, suppressed) in self._peers.items():  # what was still held back: summed up once
                    if suppressed:
                        self._file.write(
                            json.dumps(
                                {
                                    "event": "audit_suppressed",
                                    "peer": peer,
                                    "suppressed": int(suppressed),
                                    "window_s": WINDOW_S,
                                    "limit": PEER_LINES,
                                }
                            )
                            + "\n"
                        )
                self._file.close()
            except OSError:
                pass
