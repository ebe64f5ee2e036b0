"""`fleetrl keys generate DIR`: CURVE keypairs for the broker and its clients."""

from __future__ import annotations

from pathlib import Path

import zmq.auth


def generate(directory: str | Path, names: list[str]) -> list[tuple[Path, Path]]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` for each name; returns the paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        public, secret = zmq.auth.create_certificates(str(d), name)
        Path(secret).chmod(0o600)
        out.append((Path(public), Path(secret)))
    return out


def main(args) -> int:
    pairs = generate(args.dir, ["server", *args.clients])
    for public, secret in pairs:
        print(f"{public.stem}: public {public}, secret {secret}")
    print("broker: set broker.curve.server_secret_key / server_public_key; put the clients' public keys "
          "into a directory and point broker.curve.authorized_keys_dir at it.")
    return 0
