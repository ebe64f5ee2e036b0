"""`fleetrl control ACTION`: an operator pauses, resumes, stops the fleet or discards versions.

    fleetrl control pause   --broker tcp://10.0.0.1:5555 --config job.yaml --reason "maintenance" \
        broker.curve.client_secret_key=keys/operator.key_secret
    fleetrl control discard --min-version 12 --max-version 15 ...
    fleetrl control resume  ...          # also undoes `stop` and lifts every learner's rollback hold

Only an operator key may send these (a learner may only pause, resume and discard within its own
rollback, docs/broker.md#permissions); the broker writes each to its audit log.
"""

from __future__ import annotations

import sys

from fleetrl.broker.client.address import client_identity, default_client_id
from fleetrl.broker.client.errors import BrokerError, BrokerUnavailable
from fleetrl.broker.client.sync import ZmqBrokerClient
from fleetrl.common.config import load_config


def main(args) -> int:
    cfg = load_config(args.config, args.overrides) if args.config else None
    curve = cfg.broker.curve if cfg else None
    identity = client_identity(curve, "operator")
    if args.action == "discard" and (args.min_version is None or args.max_version is None):
        print("fleetrl control discard: give the closed range with --min-version and --max-version", file=sys.stderr)
        return 2
    try:
        with ZmqBrokerClient(
            args.broker, default_client_id("operator", 0, identity), "operator", timeout_s=args.timeout, curve=curve
        ) as client:
            client.connect()
            ack = client.control(
                args.action, args.reason, args.min_version or 0, -1 if args.max_version is None else args.max_version
            )
    except (BrokerUnavailable, BrokerError) as e:
        print(f"fleetrl control {args.action}: {e}", file=sys.stderr)
        return 1
    print(f"{args.action}: done" + (f", {ack.count} queued groups discarded" if args.action == "discard" else ""))
    return 0
