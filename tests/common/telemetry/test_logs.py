"""setup_logging: every line carries the process name, and the stderr handler follows ``sys.stderr``."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from fleetrl.common.telemetry.logs import setup_logging


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_logs_go_to_the_stderr_of_the_moment_not_the_one_set_up_with(root_logging, monkeypatch):
    old = io.StringIO()
    monkeypatch.setattr(sys, "stderr", old)
    setup_logging("learner-0", "INFO")
    logging.getLogger("fleetrl.test").info("first")
    old.close()  # what a test's capture does when it ends
    new = io.StringIO()
    monkeypatch.setattr(sys, "stderr", new)
    logging.getLogger("fleetrl.test").warning("second")
    line = new.getvalue()
    assert "learner-0 fleetrl.test: second" in line and "first" not in line


def test_the_file_log_gets_every_line_at_the_level(root_logging, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    setup_logging("broker", "WARNING", tmp_path / "logs" / "broker.log")
    log = logging.getLogger("fleetrl.test")
    log.info("dropped")
    log.error("kept")
    for h in logging.getLogger().handlers:
        h.flush()
    text = (tmp_path / "logs" / "broker.log").read_text()
    assert "broker fleetrl.test: kept" in text and "dropped" not in text
