"""A rollout server's membership of the fleet: leaving it at once on a clean exit, and what the job ending means.

- ``leave_fleet``: the last request of a server that stops cleanly. The broker drops it from the fleet
  at once (its leases back, out of the fleet size that sizes each weight-sync round), instead of
  after ``broker.client_timeout_s`` of silence.
- ``exits_on_done``: a ``done`` announcement (the learner finished, or the broker is shutting down) or
  a ``done:`` throttle ends a server, unless ``rollout.stay_after_done`` keeps it for the next learner.

Kept apart from the server loop so that the loop can change without these rules changing.
"""

from __future__ import annotations

import logging
from typing import Any

from fleetrl.broker.client.errors import BrokerError, BrokerUnavailable

log = logging.getLogger("fleetrl.rollout")

DONE_PREFIX = "done: "  # the reason of a broker's Throttle once the learner has finished


def leave_fleet(client: Any, reason: str) -> bool:
    """Tell the broker this server is gone (one short try); False when the broker did not answer."""
    try:
        client.leave(reason)
    except (BrokerError, BrokerUnavailable) as e:
        log.info("could not tell the broker this server leaves (%s); it drops it after broker.client_timeout_s", e)
        return False
    return True


def is_done_throttle(reason: str) -> bool:
    return reason.startswith(DONE_PREFIX)


def exits_on_done(stay_after_done: bool, reason: str, already_told: bool) -> bool:
    """Whether a server stops on ``done`` (``reason`` says why the job is over); logs the decision once."""
    if not stay_after_done:
        return True
    if not already_told:
        log.info("training is done (%s); staying up for the next learner (rollout.stay_after_done=true)", reason)
    return False
