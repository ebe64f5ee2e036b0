"""`fleetrl run`'s start-up (issue 30, item 10): the broker's clients start with it rather than after it, and
every process says where its start-up went."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from fleetrl.app.launch.run import Child, Launcher, child_env
from fleetrl.broker.client.address import WAIT_ENV, resolve_address
from fleetrl.common.config import ConfigError, load_config
from fleetrl.common.telemetry.startup import Startup

# a stand-in broker: writes broker.json (atomically, as the broker does) after 1.5 s
BROKER = (
    "import json, os, sys, time; time.sleep(1.5); p = sys.argv[1]; "
    "open(p + '.tmp', 'w').write(json.dumps({'address': 'tcp://127.0.0.1:1'})); os.replace(p + '.tmp', p); "
    "time.sleep(60)"
)
# a stand-in client: notes when it started, reports ready at once
CLIENT = "import sys, time; open(sys.argv[1], 'w').write(str(time.time())); time.sleep(60)"


def test_the_broker_s_clients_start_with_it_not_after_it(tmp_path):
    cfg = load_config(None, ["run.ready_timeout_s=30"])
    launcher = Launcher(cfg, tmp_path, status=False)
    env = child_env(1, cfg.run.ready_timeout_s)
    launcher.children = [
        Child(
            "broker",
            [sys.executable, "-c", BROKER, str(tmp_path / "broker.json")],
            tmp_path / "b.log",
            env,
            tmp_path / "broker.json",
        ),
        Child(
            "rollout-0",
            [sys.executable, "-c", CLIENT, str(tmp_path / "r.ready")],
            tmp_path / "r.log",
            env,
            tmp_path / "r.ready",
        ),
    ]
    try:
        launcher.start_all()
        client_started = float((tmp_path / "r.ready").read_text())
        broker_ready = launcher.children[0].ready_at
        assert client_started < broker_ready - 1.0, "the client waited for the broker before it started"
        line = launcher.ready_line()
        assert line.startswith("2 processes ready in ") and "broker at " in line and "rollout-0 at " in line
    finally:
        for child in launcher.children:
            child.stop(5)
    assert env[WAIT_ENV] == "30"


def test_a_client_waits_for_broker_json_only_when_told(tmp_path, monkeypatch):
    cfg = load_config(None, ["broker.port=0"]).broker

    def write_later() -> None:
        time.sleep(0.3)
        (tmp_path / "broker.json").write_text(json.dumps({"address": "tcp://0.0.0.0:4242"}))

    with pytest.raises(ConfigError, match="broker.port is 0"):  # not told: no broker.json is an error at once
        resolve_address(cfg, tmp_path)
    monkeypatch.setenv(WAIT_ENV, "20")
    writer = threading.Thread(target=write_later)
    writer.start()
    t0 = time.monotonic()
    try:
        assert resolve_address(cfg, tmp_path) == "tcp://127.0.0.1:4242"
    finally:
        writer.join()
    assert time.monotonic() - t0 < 5


def test_a_process_measures_its_start_up_from_its_exec():
    code = "import time; first = time.time(); from fleetrl.common.telemetry.startup import exec_time; print(exec_time(), first)"
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    exec_at, first_line = map(float, out.stdout.split())
    assert before - 0.03 <= exec_at <= first_line + 0.02  # between the spawn and the program's first line
    s = Startup(start=time.time() - 2.0)
    s.mark("python+imports")
    s.mark("model")
    s.mark("model")  # a phase marked twice adds up
    line = s.line()
    assert line.startswith("start-up: ready 2.") and "s after exec (python+imports 2." in line
    assert list(s.phases) == ["python+imports", "model"]
