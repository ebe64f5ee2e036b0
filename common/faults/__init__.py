"""Fault injection and chaos pins, a testing aid that is off by default, reached through one seam:
``faults.at(point, value, ...)`` and ``faults.around(point, ...)`` (``points.py``). ``plan.py`` holds the
faults (``FLEETRL_FAULT*``), ``pins.py`` the pinned states (``FLEETRL_PIN*``). Imports without torch."""

from fleetrl.common.faults.points import around, at

__all__ = ["around", "at"]
