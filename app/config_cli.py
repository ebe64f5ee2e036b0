"""`fleetrl config show|validate|docs`.

``validate`` decodes the config (unknown keys, bad values and unknown plug-in names are refused with a
did-you-mean) and then runs the up-front checks of ``checks.py`` — the same `fleetrl run` runs before it
starts anything: one line per problem, exit code 2, else ``OK``.
"""

from __future__ import annotations

import sys

from fleetrl.app.checks import check_job
from fleetrl.common.config import config_docs, dump_yaml, load_config
from fleetrl.common.config.names import defaults_used


def main(args) -> int:
    if args.action == "docs":
        print(config_docs(), end="")
        return 0
    notes: list[str] = []
    cfg = load_config(args.config, args.overrides, notes)
    for note in notes:
        print(f"fleetrl config: note: {note}", file=sys.stderr)
    if args.action == "show":
        print(dump_yaml(cfg), end="")
        return 0
    problems = check_job(cfg)
    for problem in problems:
        print(f"fleetrl config: {problem}", file=sys.stderr)
    if problems:
        return 2
    for note in defaults_used(cfg, args.config, args.overrides):
        print(f"fleetrl config: note: {note}", file=sys.stderr)
    print(f"{args.config or 'defaults'}: OK")
    return 0
