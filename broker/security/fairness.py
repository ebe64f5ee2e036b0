"""Per-key fairness (issue 31): no key can crowd out the others.

- :class:`KeyLimiter`: a token bucket per key for the requests that are cheap to send and cost the
  broker (``Register``, ``GetStatus``, ``GetVersion``): ``broker.key_requests_per_s``, bursts of twice
  that. A key beyond it is answered ``unavailable`` (the client library backs off and retries), counted
  (``counters["key_throttled"]``), and written to the audit log once per key per ``WINDOW_S`` with how
  many requests were refused since its last line. The key is the CURVE identity; without CURVE, where
  nothing is authenticated, the client id.
- :class:`PromptShares`: leased prompts per CURVE key. While another key waits for prompts (it got none
  at capacity, or over its share, in the last ``STARVE_S``), a key may hold at most
  ``capacity // keys leasing`` of them (``broker.fair_prompt_share``): a rollout key that leased all 48
  prompts and re-leased them kept the real rollout throttled. With no one waiting, one key may lease
  everything (a fleet on one key, or one fast machine, is not slowed down).

Client-table slots per key are in ``broker/server/client_table.py``; per-prompt acceptance (``group_size`` samples per
hand-out) in ``prompts.py``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

WINDOW_S = 10.0  # one audit line per throttled key per window
STARVE_S = 5.0  # a key that got no prompts this recently is waiting
MAX_KEYS = 1 << 16  # buckets kept (keys without CURVE are client ids: unbounded otherwise)


class KeyLimiter:
    def __init__(self, rate: float):
        self.rate, self.burst = rate, 2 * rate
        self.buckets: OrderedDict[str, list[float]] = OrderedDict()  # key -> [tokens, last refill]
        self.refused: Counter[str] = Counter()  # refused since the key's last audit line
        self.audited: dict[str, float] = {}

    def allow(self, key: str, now: float) -> bool:
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = [self.burst, now]
            while len(self.buckets) > MAX_KEYS:
                old, _ = self.buckets.popitem(last=False)
                self.audited.pop(old, None)
        self.buckets.move_to_end(key)
        b[0] = min(self.burst, b[0] + (now - b[1]) * self.rate)
        b[1] = now
        if b[0] >= 1.0:
            b[0] -= 1.0
            return True
        self.refused[key] += 1
        return False

    def audit_due(self, key: str, now: float) -> int:
        """How many requests of ``key`` were refused since its last audit line, when a line is due (else 0)."""
        if now - self.audited.get(key, -WINDOW_S) < WINDOW_S:
            return 0
        self.audited[key] = now
        return self.refused.pop(key, 0)


class PromptShares:
    def __init__(self) -> None:
        self.waiting: OrderedDict[str, float] = OrderedDict()  # key -> when it last got no prompts

    def starved(self, key: str, now: float) -> None:
        self.waiting[key] = now
        self.waiting.move_to_end(key)
        while self.waiting and now - next(iter(self.waiting.values())) > STARVE_S:
            self.waiting.popitem(last=False)

    def share(self, key: str, held: Counter[str], capacity: int, now: float) -> int | None:
        """Most prompts ``key`` may hold now (``held``: open leased prompts per key), or None: no one else waits."""
        waiting = {k for k, t in self.waiting.items() if now - t <= STARVE_S}
        if not waiting - {key}:
            return None
        leasing = waiting | {k for k, n in held.items() if n > 0} | {key}
        return max(1, capacity // len(leasing))
