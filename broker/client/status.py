"""`fleetrl status --broker ADDR`: what the broker holds and who is connected."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import zmq
from rich.console import Console
from rich.table import Table

from fleetrl.broker.client.address import client_identity, default_client_id
from fleetrl.broker.client.errors import BrokerUnavailable
from fleetrl.broker.client.metrics import status_metrics
from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.common import messages as m
from fleetrl.common.config import load_config


def render(status: m.Status) -> Table:
    table = Table(
        title=f"broker {status.broker_id} — up {status.uptime_s:.0f} s, policy version {status.policy_version}"
        + (" [PAUSED]" if status.paused else ""),
        show_header=True,
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("queue depth (groups)", status.queue_depth),
        ("groups leased to learners", status.groups_in_flight),
        ("prompts leased to rollouts", status.prompts_leased),
        ("uncommitted groups", status.uncommitted),
        ("groups in / out", f"{status.groups_in} / {status.groups_out}"),
        ("groups in / out per s", f"{status.groups_in_per_s:.1f} / {status.groups_out_per_s:.1f}"),
        ("dropped stale", status.dropped_stale),
        ("duplicates", status.duplicates),
        ("throttled", status.throttled),
        ("rejected", ", ".join(f"{k}={v}" for k, v in status.rejected.items()) or "0"),
        ("staleness histogram", ", ".join(f"{k}:{v}" for k, v in status.staleness_hist.items()) or "-"),
        ("data epoch / cursor", f"{status.data_epoch} / {status.data_cursor}"),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    for c in status.clients:
        state = "alive" if c.alive else "DEAD"
        table.add_row(f"{c.role} {c.client_id}", f"v{c.policy_version}, seen {c.last_seen_s:.1f} s ago, {state}")
    return table


def broker_target(target: str) -> str:
    """``--broker``: a ZeroMQ address as given, or a run directory, whose ``broker.json`` (the broker writes it
    with the port it bound) holds the address. Anything else raises ValueError saying what to pass."""
    if "://" in target:
        return target
    endpoint = Path(target) / "broker.json"
    if Path(target).is_dir():
        if not endpoint.exists():
            raise ValueError(
                f"{target} is a directory but holds no broker.json: pass the run directory of a running "
                "job (`fleetrl run` prints it) or the broker's address, e.g. tcp://127.0.0.1:5555"
            )
        return json.loads(endpoint.read_text())["address"]
    raise ValueError(f"--broker {target!r} is neither an address (tcp://HOST:PORT) nor a run directory")


def main(args) -> int:
    cfg = load_config(args.config, args.overrides) if args.config else None
    curve = cfg.broker.curve if cfg else None
    console = Console()
    try:
        address = broker_target(args.broker)
        identity = client_identity(curve, "status")
        client = ZmqBrokerClient(
            address, default_client_id("status", 0, identity), "monitor", timeout_s=args.timeout, curve=curve
        )
        client.connect()
    except (BrokerUnavailable, ValueError, zmq.ZMQError) as e:
        print(f"fleetrl status: {e}", file=sys.stderr)
        return 1
    try:
        while True:
            status = client.status()
            if args.json:
                out = m.to_dict(status)
                out["metrics"] = status_metrics(status)
                print(json.dumps(out))
            else:
                console.print(render(status))
            if not args.watch:
                return 0
            time.sleep(args.watch)
    finally:
        client.close()
