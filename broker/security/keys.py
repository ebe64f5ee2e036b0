"""`fleetrl keys generate DIR`: CURVE keypairs for the broker and its clients, and the broker's allowlist.

Writes, all owner-only (directories 0700, secret files 0600)::

    DIR/server.key, DIR/server.key_secret         the broker's pair
    DIR/<identity>.key, DIR/<identity>.key_secret each client's pair (copy it to the machine that uses it)
    DIR/clients/<role>/<identity>.key             the allowlist: broker.curve.authorized_keys_dir=DIR/clients

By default one key per role: ``rollout``, ``learner`` and ``operator`` (``--rollout a b``,
``--learner ...``, ``--operator ...``, ``--monitor ...`` choose the identities). A client's ids start
with its identity (``learner`` -> ``learner-0``), so identities must not be prefixes of each other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import zmq.auth

from fleetrl.broker.security.auth import ROLES, load_key_table

DEFAULTS = {"rollout": ["rollout"], "learner": ["learner"], "operator": ["operator"], "monitor": []}


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def _pair(directory: Path, name: str) -> tuple[Path, Path]:
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def generate(directory: str | Path, roles: dict[str, list[str]] | None = None) -> dict[str, tuple[Path, Path]]:
    """Write the server pair, one pair per (role, identity), and the allowlist; returns name -> (public, secret)."""
    d = _private_dir(Path(directory))
    roles = DEFAULTS if roles is None else roles
    out = {"server": _pair(d, "server")}
    for role, names in roles.items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
        allow = _private_dir(d / "clients" / role)
        for name in names:
            out[name] = _pair(d, name)
            shutil.copy(out[name][0], allow / f"{name}.key")
    load_key_table(str(d / "clients"))  # refuses identities that overlap, like the broker would
    return out


def main(args) -> int:
    roles = {role: list(getattr(args, role)) if getattr(args, role) is not None else DEFAULTS[role] for role in ROLES}
    pairs = generate(args.dir, roles)
    for name, (public, secret) in pairs.items():
        print(f"{name}: public {public}, secret {secret}")
    print(
        f"broker: broker.curve.server_secret_key={pairs['server'][1]} server_public_key={pairs['server'][0]} "
        f"authorized_keys_dir={Path(args.dir) / 'clients'}"
    )
    print(
        "clients: broker.curve.client_secret_key=<DIR>/<identity>.key_secret (copy it, mode 0600, and server.key "
        "to each machine)"
    )
    return 0
