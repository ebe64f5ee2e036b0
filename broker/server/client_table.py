"""The broker's client table: who registered, when each was last seen, what it reported. Bounded.

A client record is created by ``Register`` only (any other request from an unknown client id is
answered ``unregistered``, and the client library registers again); at ``broker.max_clients`` the
longest-silent dead client is evicted to make room, and Register is refused ``unavailable`` when none
is dead. Dead clients (silent for ``broker.client_timeout_s``) are evicted anyway after ten times that.
Register info and heartbeat stats are refused beyond ``broker.max_client_info_bytes`` each, and all
clients' together are bounded by ``broker.max_client_table_bytes`` (issue 31: 4,000 clients reporting
16 KiB of stats each held 400 MB, a decoded entry costing ~7 times its bytes): beyond it a heartbeat's
stats are dropped (the heartbeat still counts), and a Register evicts monitors, else is refused.

Per key (issue 31: one monitor key filled the 4,096-slot table and a real rollout and a restarted
learner got ``unavailable`` 10 of 10 times): a CURVE key holds at most ``broker.max_clients_per_key``
records (at its cap its own longest-silent dead record makes room, else its Register is refused and
no other key is touched); records registered as ``monitor`` are at most ``broker.max_monitor_clients``
(the longest-silent goes first); and when the table is full of live clients, a Register evicts the
longest-silent monitor: monitors never displace a rollout, a learner or an operator. Counters about a client (``tally``: its implausible groups) live
beside the records and survive its re-registration.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetrl.common import messages as m
from fleetrl.common.config.schema import BrokerConfig

ROW_BYTES = 96  # a status row besides its id, role and stats
FLEET_FIRST = {"learner": 0, "rollout": 1, "operator": 2}  # status rows: these before monitors

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
    held: int = 0  # info_size of its info and stats: what it counts against broker.max_client_table_bytes
    admit_from: int = (
        0  # a rollout leases prompts only once it holds at least this version (the current one at Register)
    )


ENTRY = 32  # what one entry of info or stats costs besides its key and value (it takes ~100 bytes decoded)


def info_size(values: Mapping[str, object]) -> int:
    """Bytes a Register info / Heartbeat stats mapping costs: key and value lengths, 8 per number, ENTRY each."""
    return sum(len(k) + (len(v) if isinstance(v, str) else 8) + ENTRY for k, v in values.items())


def wire_size(values: Mapping[str, object]) -> int:
    """At least the msgpack size of such a mapping (a string's header: up to 3 bytes; a float: 9)."""
    return 5 + sum(len(k) + 3 + (len(v) + 3 if isinstance(v, str) else 9) for k, v in values.items())


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
        # CURVE identity -> its client ids, least recently seen first
        self.by_key: dict[str, OrderedDict[str, None]] = {}
        self.monitors: OrderedDict[str, None] = OrderedDict()  # client ids registered as monitor, likewise
        self.tallies: OrderedDict[str, Counter[str]] = OrderedDict()  # client id -> counters about it (bounded)
        self.held = 0  # info_size of every record's info and stats
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
            if c.identity:
                self.by_key[c.identity].move_to_end(c.client_id)
            if c.role == "monitor":
                self.monitors.move_to_end(c.client_id)

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
        """Add or replace a record; a reason when there is no room for it (see the module docstring)."""
        self.remove(client.client_id)
        client.held = info_size(client.info)
        full = self._make_room(client, now)
        if full:
            return full
        client.last_seen = now
        self.clients[client.client_id] = client
        self.held += client.held
        if client.identity:
            self.by_key.setdefault(client.identity, OrderedDict())[client.client_id] = None
        if client.role == "monitor":
            self.monitors[client.client_id] = None
        return None

    def _make_room(self, client: ClientState, now: float) -> str | None:
        """Evict what must go for ``client`` to fit (per key, monitors, the table); a reason when nothing may."""
        b = self.bcfg
        mine: Mapping[str, None] = self.by_key.get(client.identity, {}) if client.identity else {}
        if len(mine) >= b.max_clients_per_key:
            oldest = self.clients[next(iter(mine))]
            if self.alive(oldest, now):
                return (
                    f"key {client.identity!r} holds {len(mine)} live clients (broker.max_clients_per_key="
                    f"{b.max_clients_per_key}); retry later, or register fewer client ids with this key"
                )
            self._evict(oldest.client_id)
        if client.role == "monitor" and len(self.monitors) >= b.max_monitor_clients:
            self._evict(next(iter(self.monitors)))
        if len(self.clients) >= b.max_clients:
            oldest = next(iter(self.clients.values()))
            if not self.alive(oldest, now):
                self._evict(oldest.client_id)
            elif self.monitors:
                self._evict(next(iter(self.monitors)))  # monitors make room before any fleet role
            else:
                return (
                    f"the broker holds {len(self.clients)} live clients (broker.max_clients="
                    f"{b.max_clients}); retry later or raise that setting"
                )
        while self.held + client.held > b.max_client_table_bytes:
            if not self.monitors or client.role == "monitor":
                return (
                    f"the clients' info and stats take {self.held} bytes (broker.max_client_table_bytes="
                    f"{b.max_client_table_bytes}); retry later or raise that setting"
                )
            self._evict(next(iter(self.monitors)))
        return None

    def set_stats(self, c: ClientState, stats: dict[str, float]) -> bool:
        """A heartbeat's stats, unless they would take the table past broker.max_client_table_bytes (then none)."""
        size, old = info_size(stats), info_size(c.stats)
        keep = self.held - old + size <= self.bcfg.max_client_table_bytes
        c.stats = stats if keep else {}
        delta = (size if keep else 0) - old
        c.held += delta
        if c.client_id in self.clients:
            self.held += delta
        return keep

    def _evict(self, client_id: str) -> None:
        self.remove(client_id)
        self.evicted += 1

    def remove(self, client_id: str) -> ClientState | None:
        """Forget a record (a Leave, an eviction, a re-registration); its tallies stay."""
        c = self.clients.pop(client_id, None)
        if c is not None:
            self.held -= c.held
            if c.identity:
                mine = self.by_key.get(c.identity)
                if mine is not None:
                    mine.pop(client_id, None)
                    if not mine:
                        del self.by_key[c.identity]
            self.monitors.pop(client_id, None)
        return c

    def tally(self, client_id: str, key: str, n: int = 1) -> None:
        """Count ``key`` against ``client_id`` (kept for as many client ids as broker.max_clients)."""
        t = self.tallies.get(client_id)
        if t is None:
            t = self.tallies[client_id] = Counter()
            while len(self.tallies) > self.bcfg.max_clients:
                self.tallies.popitem(last=False)
        self.tallies.move_to_end(client_id)
        t[key] += n

    def rows(self, now: float, budget: int) -> tuple[list[m.ClientInfo], int, int]:
        """The status rows, learners then rollouts then operators then monitors, within ``budget`` bytes: (rows,
        rows left out from the end, rows listed without their stats). Rows (with their counters) come before stats."""
        order = sorted(self.clients.values(), key=lambda c: FLEET_FIRST.get(c.role, 3))
        bare = [
            ROW_BYTES + len(c.client_id) + len(c.role) + wire_size(self.tallies.get(c.client_id, {})) for c in order
        ]
        keep = len(order)
        while keep and sum(bare[:keep]) > budget:
            keep = max(0, keep - max(1, keep // 8))
        room = budget - sum(bare[:keep])
        rows, stats_omitted = [], 0
        for c in order[:keep]:
            counters = dict(self.tallies.get(c.client_id, {}))
            cost = c.held - info_size(c.info) + (40 if c.groups_pushed else 0)  # >= the stats' msgpack size
            if cost > room:
                stats, stats_omitted = {}, stats_omitted + 1
            else:
                room -= cost
                stats = {**c.stats, "groups_pushed": float(c.groups_pushed)} if c.groups_pushed else c.stats
            rows.append(
                m.ClientInfo(
                    client_id=c.client_id,
                    role=c.role,
                    rank=c.rank,
                    policy_version=c.policy_version,
                    last_seen_s=round(now - c.last_seen, 3),
                    alive=self.alive(c, now),
                    stats=stats,
                    receivers=int(c.info.get("receivers", 1)),
                    counters=counters,
                )
            )
        return rows, len(order) - keep, stats_omitted

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
        while self.clients and now - (oldest := next(iter(self.clients.values()))).last_seen > limit:
            gone.append(oldest.client_id)
            self.remove(oldest.client_id)
        self.evicted += len(gone)
        return gone
