"""The broker's ``Status`` reply as namespaced monitor metrics.

``broker/...`` are the broker's own queue, rates and staleness (and, from the socket broker's
`WireStats` in ``server/rates.py``, its bytes in and out and its process's ``resource/broker/*``);
``fleet/...`` aggregate the stats the rollout servers send with their heartbeats. The learner logs both
every step; `fleetrl status --json` prints them.
"""

from __future__ import annotations

from fleetrl.common import messages as m


def status_metrics(status: m.Status) -> dict[str, float]:
    """The broker's status as namespaced metrics for the monitor (``broker/...``)."""
    hist = {int(k): v for k, v in status.staleness_hist.items()}
    handed = sum(hist.values())
    return {
        "broker/queue_depth": status.queue_depth,
        "broker/groups_in_flight": status.groups_in_flight,
        "broker/prompts_leased": status.prompts_leased,
        "broker/groups_in_per_s": status.groups_in_per_s,
        "broker/groups_out_per_s": status.groups_out_per_s,
        "broker/groups_in": status.groups_in,
        "broker/dropped_stale": status.dropped_stale,
        "broker/duplicates": status.duplicates,
        "broker/rejected": sum(status.rejected.values()),
        "broker/throttled": status.throttled,
        "broker/staleness_mean": sum(k * v for k, v in hist.items()) / handed if handed else 0.0,
        "broker/staleness_max": max(hist) if hist else 0,
        "broker/clients_alive": sum(c.alive for c in status.clients),
        "broker/uncommitted": status.uncommitted,
        "broker/policy_version": status.policy_version,
        **status.stats,  # broker/bytes_{in,out}[_per_s], resource/broker/* (the socket broker only)
        **fleet_metrics(status),
    }


def expected_receivers(status: m.Status) -> int:
    """How many weight receivers the next broadcast round should wait for: every live rollout server's
    registered count (a tensor-parallel vLLM server has one per worker), not the number of servers."""
    return sum(c.receivers for c in status.clients if c.role == "rollout" and c.alive)


def fleet_metrics(status: m.Status) -> dict[str, float]:
    """Aggregates of the rollout servers' heartbeat stats (``fleet/...``); per-server series are in
    each server's ``rollout-<i>.metrics.jsonl``."""
    stats = [c.stats for c in status.clients if c.role == "rollout" and c.alive]
    total = lambda key: float(sum(s.get(key, 0.0) for s in stats))  # noqa: E731
    return {
        "fleet/servers": float(len(stats)),
        "fleet/receivers": float(expected_receivers(status)),
        "fleet/tokens_per_s": total("rollout/tokens_per_s"),
        "fleet/reward_mean": total("reward/mean") / len(stats) if stats else 0.0,
        "fleet/groups_pushed": total("rollout/groups_pushed"),
        "fleet/groups_dropped": total("rollout/groups_dropped"),
        "fleet/throttles": total("rollout/throttles"),
        "fleet/paused": total("rollout/paused"),
        "fleet/version_lag_max": max(
            (status.policy_version - s.get("rollout/policy_version", 0.0) for s in stats), default=0.0
        ),
        "fleet/weights_load_s_max": float(max((s.get("weights/load_s", 0.0) for s in stats), default=0.0)),
        **fleet_resources(stats),
    }


def fleet_resources(stats: list[dict[str, float]]) -> dict[str, float]:
    """The rollout servers' ``resource/rollout/*`` (CPU, RSS, GPU) and weight-load bandwidth, aggregated:
    a key only the servers that report it count in, and a key no server reports is left out (no GPU: no
    GPU keys)."""
    out: dict[str, float] = {}
    for key, how in (
        ("cpu_percent", "max"),
        ("cpu_percent", "mean"),
        ("rss_mb", "max"),
        ("gpu_util_percent", "mean"),
        ("gpu_mem_mb", "max"),
    ):
        values = [s[f"resource/rollout/{key}"] for s in stats if f"resource/rollout/{key}" in s]
        if values:
            out[f"resource/rollout/{key}_{how}"] = max(values) if how == "max" else sum(values) / len(values)
    loads = [s["weights/load_mb_per_s"] for s in stats if s.get("weights/load_mb_per_s")]
    if loads:
        out["fleet/weights_load_mb_per_s_min"] = min(loads)
    return out
