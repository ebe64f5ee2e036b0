"""Who is asking: CURVE keys bound to roles and identities, and the broker's start-up security checks.

The allowlist (``broker.curve.authorized_keys_dir``) holds one subdirectory per role, each with the
public keys of that role, one ``<identity>.key`` file per key::

    keys/clients/rollout/rollout.key       keys/clients/learner/learner.key
    keys/clients/operator/alice.key        keys/clients/monitor/grafana.key   (read-only)

During the CURVE handshake the broker's ZAP handler (:class:`RoleAuthenticator`) admits only these
keys and labels the connection ``<role>:<identity>``; ZeroMQ attaches that label to every frame the
connection sends (its ``User-Id``), and :func:`principal_of` turns it back into a :class:`Principal`.
A key's identity also owns a namespace of client ids: ``identity`` itself and ``identity-*``
(``learner`` owns ``learner-0``, ``learner-1``, ...), so one key can never act for another's client.

Without CURVE nothing is authenticated: the broker binds loopback only (unless
``broker.insecure_bind``) and takes each client's role from its ``Register`` (not a security
boundary; it keeps mis-wired processes apart).
"""

from __future__ import annotations

import ipaddress
import logging
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from fleetrl.common.config import ConfigError
from fleetrl.common.config.schema import BrokerConfig

log = logging.getLogger(__name__)

ROLES = ("rollout", "learner", "operator", "monitor")


@dataclass(frozen=True)
class Principal:
    """The key behind a request: its identity and role (``authenticated`` False without CURVE)."""

    identity: str
    role: str
    authenticated: bool = True

    def owns(self, client_id: str) -> bool:
        """Whether ``client_id`` lies in this key's namespace (always true without authentication)."""
        if not self.authenticated:
            return True
        return client_id == self.identity or client_id.startswith(self.identity + "-")


UNAUTHENTICATED = Principal("", "", authenticated=False)  # the server without CURVE: roles come from Register


def principal_of(user_id: str) -> Principal:
    """The Principal of a frame's ZAP ``User-Id`` (``role:identity``)."""
    role, _, identity = user_id.partition(":")
    return Principal(identity, role) if role in ROLES and identity else Principal(user_id or "?", "unknown")


# ---------------------------------------------------------------------------------- the allowlist


@dataclass(frozen=True)
class KeyEntry:
    role: str
    identity: str
    path: str


def load_key_table(directory: str | None) -> dict[bytes, KeyEntry]:
    """z85 public key -> its role and identity, from the role subdirectories of ``directory``.

    Refused (ConfigError naming ``broker.curve.authorized_keys_dir``): no directory, a missing or empty
    one, ``*.key`` files outside a role subdirectory (the old flat layout), an unknown subdirectory,
    a file that is not a public key, one key under two names, and identities whose client-id
    namespaces overlap (``a`` and ``a-b``)."""
    key = "broker.curve.authorized_keys_dir"
    if not directory:
        raise ConfigError(
            f"{key} is not set: with broker.curve the broker needs an allowlist of client keys, one "
            f"subdirectory per role ({', '.join(ROLES)}); create it with `fleetrl keys generate DIR`"
        )
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(
            f"{key}={directory!r} is not a directory; create it with `fleetrl keys generate DIR` "
            "(it writes DIR/clients/<role>/<identity>.key)"
        )
    flat = sorted(p.name for p in root.glob("*.key"))
    if flat:
        raise ConfigError(
            f"{key}={directory!r} holds keys outside a role subdirectory ({', '.join(flat[:5])}); move "
            f"each into {directory}/<role>/ with role one of {', '.join(ROLES)}"
        )
    table: dict[bytes, KeyEntry] = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        if sub.name not in ROLES:
            raise ConfigError(f"{key}: unknown role directory {str(sub)!r}; the roles are {', '.join(ROLES)}")
        for path in sorted(sub.glob("*.key")):
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (ValueError, OSError) as e:
                raise ConfigError(f"{key}: {path} is not a CURVE public key file ({e})") from None
            if public in table:
                raise ConfigError(f"{key}: {path} repeats the key of {table[public].path}; give each key one role")
            table[public] = KeyEntry(sub.name, path.stem, str(path))
    if not table:
        raise ConfigError(
            f"{key}={directory!r} holds no keys; put client public keys into {directory}/<role>/ "
            f"(roles: {', '.join(ROLES)}) or generate them with `fleetrl keys generate`"
        )
    _check_namespaces(table)
    return table


def _check_namespaces(table: dict[bytes, KeyEntry]) -> None:
    idents = sorted(table.values(), key=lambda e: e.identity)
    for a, b in zip(idents, idents[1:]):
        if b.identity == a.identity or b.identity.startswith(a.identity + "-"):
            raise ConfigError(
                f"broker.curve.authorized_keys_dir: identities {a.identity!r} ({a.path}) and "
                f"{b.identity!r} ({b.path}) overlap: client ids of the second would belong to the "
                "first; rename one of the key files"
            )


def check_secret_file(path: str, key: str) -> None:
    """A secret key file must exist and be readable by its owner only."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}={path!r} does not exist; create keys with `fleetrl keys generate DIR`")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"{key}={path!r} is readable by others (mode {mode:04o}); run `chmod 600 {path}`")


class RoleAuthenticator(ThreadAuthenticator):
    """ZAP handler: admits the keys of the allowlist and labels each connection ``role:identity``. On the
    announcement socket (ZAP domain ``pub``) only ``pub_roles`` may subscribe: announcements carry the
    broadcast rounds' secrets."""

    def __init__(
        self, ctx: zmq.Context, table: dict[bytes, KeyEntry], on_refused=None, pub_roles: tuple[str, ...] = ROLES
    ):
        super().__init__(ctx)
        self.table, self.on_refused, self.pub_roles = table, on_refused, pub_roles
        self.refused = 0

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(domain="requests", credentials_provider=self)
        self.configure_curve_callback(domain="pub", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """(ZAP thread) Whether the z85 ``key`` may connect to the socket of ``domain``."""
        entry = self.table.get(key)
        if entry is not None and (domain != "pub" or entry.role in self.pub_roles):
            return True
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused(key.decode("ascii", "replace"), domain)
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        entry = self.table[z85.encode(client_public_key)]
        return f"{entry.role}:{entry.identity}"


# ------------------------------------------------------------------------------------- binding


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(bcfg: BrokerConfig) -> str | None:
    """Refuse a non-loopback plaintext bind unless ``broker.insecure_bind``; the warning to log, else None."""
    if bcfg.curve is not None or is_loopback(bcfg.host):
        return None
    if not bcfg.insecure_bind:
        raise ConfigError(
            f"broker.host={bcfg.host!r} is not a loopback address and broker.curve is not set: anyone who "
            "reaches the port could lease, push and control the job. Turn on broker.curve (see "
            "docs/broker.md#security), bind 127.0.0.1, or set broker.insecure_bind=true to accept the risk"
        )
    return (
        f"broker.insecure_bind: serving plaintext on {bcfg.host} without authentication; every client that "
        "reaches this port is trusted with every role"
    )


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (each connection holds a descriptor); returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # pragma: no cover - a container that forbids it
            pass
    return soft
