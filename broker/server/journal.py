"""The journal: every change to the broker's durable state is written to the spool *before* it is made.

``Journal.write(records)`` is the one way the state machine and its pieces (ingest, controls, batch
leases) reach the spool. A write that fails (a full disk) raises ``SpoolUnavailable`` and nothing is
changed; the first failure is alerted and audited, and the journal says so again once writes succeed.
Without a spool (``broker.spool_dir`` unset) a write does nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from fleetrl.broker.server import spool as sp

log = logging.getLogger("fleetrl.broker.server.state")


class Journal:
    def __init__(self, spool: sp.Spool | None, counters: Counter[str], audit_event: Callable[[dict[str, Any]], None]):
        self.spool, self.counters, self.audit_event = spool, counters, audit_event
        self.failing = ""  # the error while the spool cannot be written ("" = fine)

    @property
    def enabled(self) -> bool:
        return self.spool is not None

    def write(self, records: list[sp.Record]) -> None:
        """Write ``records`` before the change they describe; raises SpoolUnavailable (nothing changed)."""
        if self.spool is None or not records:
            return
        try:
            self.spool.write(records)
        except sp.SpoolUnavailable as e:
            self.counters["spool_unavailable"] += 1
            if not self.failing:
                log.error(
                    "ALERT: the spool at %s cannot be written (%s); pushes and leases are answered `unavailable` "
                    "until it can, and serving resumes by itself when space returns",
                    self.spool.dir,
                    e,
                )
                self.audit_event({"event": "spool_unavailable", "error": str(e)})
            self.failing = str(e)
            raise
        if self.failing:
            log.warning("the spool at %s is writable again; serving normally", self.spool.dir)
            self.audit_event({"event": "spool_writable"})
            self.failing = ""
