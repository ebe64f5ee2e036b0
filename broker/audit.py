"""The broker's audit log: one JSON line per security-relevant event, in ``<run dir>/audit.jsonl``.

Every ``Control``, version publish, commit and rewind, every refused request and refused CURVE key,
and the spool becoming unwritable (and writable again), each with the identity and role of the key
behind it. The file is owner-only (0600) and appended to, flushed per line; the ZAP thread writes to
it too, hence the lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class AuditLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.chmod(self.path, 0o600)
        self._file = os.fdopen(fd, "a", buffering=1)
        self._lock = threading.Lock()
        self.failed = 0

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str)
        with self._lock:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as e:  # a full disk must not stop the broker; the event is logged instead
                self.failed += 1
                log.warning("audit: could not write %s (%s)", line, e)

    def close(self) -> None:
        with self._lock:
            try:
                self._file.close()
            except OSError:
                pass
