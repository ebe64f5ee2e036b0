"""`fleetrl config show|validate|docs`."""

from __future__ import annotations

from fleetrl.common.config import config_docs, dump_yaml, load_config


def main(args) -> int:
    if args.action == "docs":
        print(config_docs(), end="")
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.action == "show":
        print(dump_yaml(cfg), end="")
    else:
        print(f"{args.config or 'defaults'}: OK")
    return 0
