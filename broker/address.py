"""Where a client finds the broker, and the id it registers under.

The address comes from the command line (``--broker``), the config (``broker.address``), the
``broker.json`` the broker writes into its run directory with the port it actually bound (needed when
``broker.port`` is 0), or ``broker.host`` and ``broker.port`` — in that order.
"""

from __future__ import annotations

import os
import socket


def resolve_address(cfg_broker, run_dir: str | os.PathLike | None = None, override: str | None = None) -> str:
    """Where to reach the broker: ``override`` (--broker), else ``broker.address``, else the address in
    ``<run dir>/broker.json`` (the broker writes it with the port it bound), else
    ``tcp://{broker.host}:{broker.port}``."""
    if override:
        return override
    if cfg_broker.address:
        return cfg_broker.address
    endpoint = os.path.join(run_dir, "broker.json") if run_dir is not None else None
    if endpoint is not None and os.path.isfile(endpoint):
        import json

        with open(endpoint) as f:
            return json.load(f)["address"].replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
    if cfg_broker.port == 0:
        from fleetrl.common.config import ConfigError

        raise ConfigError("broker.port is 0 (the broker picks a free port), so its address cannot be derived; "
                          "pass --broker ADDR, set broker.address, or --run-dir of the broker (its broker.json)")
    return f"tcp://{cfg_broker.host}:{cfg_broker.port}"


def default_client_id(role: str, index: int = 0) -> str:
    return f"{role}-{index}-{socket.gethostname()}-{os.getpid()}"
