"""Where a client finds the broker, and the id it registers under.

The address comes from the command line (``--broker``), the config (``broker.address``), the
``broker.json`` the broker writes into its run directory with the port it actually bound (needed when
``broker.port`` is 0), or ``broker.host`` and ``broker.port`` — in that order. `fleetrl run` starts the
broker and its clients together (their imports and model loading overlap the broker's start): it sets
``FLEETRL_BROKER_WAIT_S`` in their environment, and a client then waits that long for ``broker.json``.

Client ids start with the client's *identity*: under CURVE the name its key is filed under in the
broker's allowlist (``broker.curve.client_identity``, else the secret key file's name), without
CURVE its role. A key may only act for client ids in its namespace (``identity`` and ``identity-*``).
"""

from __future__ import annotations

import os
import socket
import time

WAIT_ENV = "FLEETRL_BROKER_WAIT_S"  # seconds a client waits for broker.json (set by `fleetrl run` for its children)


def resolve_address(cfg_broker, run_dir: str | os.PathLike | None = None, override: str | None = None) -> str:
    """Where to reach the broker: ``override`` (--broker), else ``broker.address``, else the address in
    ``<run dir>/broker.json`` (the broker writes it with the port it bound), else
    ``tcp://{broker.host}:{broker.port}``."""
    if override:
        return override
    if cfg_broker.address:
        return cfg_broker.address
    endpoint = os.path.join(run_dir, "broker.json") if run_dir is not None else None
    if endpoint is not None:
        wait_for_file(endpoint, float(os.environ.get(WAIT_ENV) or 0))
    if endpoint is not None and os.path.isfile(endpoint):
        import json

        with open(endpoint) as f:
            return json.load(f)["address"].replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
    if cfg_broker.port == 0:
        from fleetrl.common.config import ConfigError

        raise ConfigError(
            "broker.port is 0 (the broker picks a free port), so its address cannot be derived; "
            "pass --broker ADDR, set broker.address, or --run-dir of the broker (its broker.json)"
        )
    return f"tcp://{cfg_broker.host}:{cfg_broker.port}"


def wait_for_file(path: str, timeout_s: float) -> bool:
    """Whether ``path`` exists, looking every 20 ms for up to ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not os.path.isfile(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def client_identity(curve, role: str) -> str:
    """The identity client ids start with: ``curve.client_identity``, else the secret key file's name
    (``keys/rollout.key_secret`` -> ``rollout``), else (no CURVE) the role."""
    if curve is None:
        return role
    if curve.client_identity:
        return curve.client_identity
    if curve.client_secret_key:
        name = os.path.basename(curve.client_secret_key)
        return name[: -len(".key_secret")] if name.endswith(".key_secret") else name.split(".")[0]
    return role


def default_client_id(role: str, index: int = 0, identity: str | None = None) -> str:
    """``<identity>-<index>-<host>-<pid>`` (identity defaults to the role)."""
    return f"{identity or role}-{index}-{socket.gethostname()}-{os.getpid()}"
