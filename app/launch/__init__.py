"""Launching a job: `fleetrl run` on one machine (``run.py``, with its live status line in ``status.py``)."""
