"""The broker's client table: who registered, when each was last seen, what it reported. Bounded.

A client record is created by ``Register`` only (any other request from an unknown client id is
answered ``unregistered``, and the client library registers again); at ``broker.max_clients`` the
longest-silent dead client is evicted to make room, and Register is refused ``unavailable`` when none
is dead. Dead clients (silent for ``broker.client_timeout_s``) are evicted anyway after ten times that.
Register info and heartbeat stats are refused beyond ``broker.max_client_info_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetrl.common.config.schema import BrokerConfig

EVICT_AFTER = 10  # dead clients are dropped after this many client_timeout_s of silence


@dataclass
class ClientState:
    client_id: str
    role: str
    identity: str = ""
    rank: int = 0
    policy_version: int = 0
    last_seen: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    groups_pushed: int = 0
    admit_from: int = (
        0  # a rollout leases prompts only once it holds at least this version (the current one at Register)
    )


def info_size(values: Mapping[str, object]) -> int:
    """Bytes a Register info / Heartbeat stats mapping costs: key and value lengths, 8 per number."""
    return sum(len(k) + (len(v) if isinstance(v, str) else 8) for k, v in values.items())


MAX_RECEIVERS = 4096


def receivers_error(info: Mapping[str, str]) -> str:
    """Why a Register's ``info["receivers"]`` (weight receivers behind the client) is unusable, or ''."""
    value = info.get("receivers", "1")
    if not value.isdigit() or not 1 <= int(value) <= MAX_RECEIVERS:
        return (
            f"Register.info['receivers'] must be a whole number of weight receivers, 1..{MAX_RECEIVERS} "
            f"(one per tensor-parallel worker), got {value!r}"
        )
    return ""


class ClientTable:
    def __init__(self, bcfg: BrokerConfig):
        self.bcfg = bcfg
        self.clients: OrderedDict[str, ClientState] = OrderedDict()  # least recently seen first
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.clients)

    def __getitem__(self, client_id: str) -> ClientState:
        return self.clients[client_id]

    def get(self, client_id: str) -> ClientState | None:
        return self.clients.get(client_id)

    def seen(self, c: ClientState, now: float) -> None:
        """A request from ``c``: it moves to the back (the front is the longest silent: the one to evict)."""
        c.last_seen = now
        if c.client_id in self.clients:
            self.clients.move_to_end(c.client_id)

    def alive(self, c: ClientState, now: float) -> bool:
        return now - c.last_seen <= self.bcfg.client_timeout_s

    def dead(self, now: float) -> set[str]:
        """Clients silent for client_timeout_s (from the front: O(dead))."""
        out = set()
        for c in self.clients.values():
            if self.alive(c, now):
                break
            out.add(c.client_id)
        return out

    def too_large(self, values: Mapping[str, object], what: str) -> str | None:
        size = info_size(values)
        if size > self.bcfg.max_client_info_bytes:
            return (
                f"{what} of {size} bytes is over broker.max_client_info_bytes={self.bcfg.max_client_info_bytes}; "
                "send fewer or shorter entries, or raise that setting"
            )
        return None

    def register(self, client: ClientState, now: float) -> str | None:
        """Add or replace a record; a reason when the table is full of live clients."""
        if client.client_id not in self.clients and len(self.clients) >= self.bcfg.max_clients:
            oldest = next(iter(self.clients.values()))
            if self.alive(oldest, now):
                return (
                    f"the broker holds {len(self.clients)} live clients (broker.max_clients="
                    f"{self.bcfg.max_clients}); retry later or raise that setting"
                )
            del self.clients[oldest.client_id]
            self.evicted += 1
        client.last_seen = now
        self.clients[client.client_id] = client
        self.clients.move_to_end(client.client_id)
        return None

    def create(self, client_id: str, role: str, now: float) -> ClientState:
        """A record for a trusted in-process caller that skipped Register (state-machine tests)."""
        c = self.clients.get(client_id)
        if c is None:
            c = ClientState(client_id, role or "unknown")
            if self.register(c, now) is not None:
                c.last_seen = now  # over the cap: served, not kept
        return c

    def evict_dead(self, now: float) -> list[str]:
        """Drop clients silent for EVICT_AFTER x client_timeout_s (from the front: O(evicted))."""
        limit = EVICT_AFTER * self.bcfg.client_timeout_s
        gone = []
        while self.clients and now - next(iter(self.clients.values())).last_seen > limit:
            gone.append(self.clients.popitem(last=False)[0])
        self.evicted += len(gone)
        return gone
