"""The `fleetrl` command line.

Every sub-command is declared here (so `fleetrl X --help` works without importing torch) and maps to
a ``module:function`` that is imported only when the command runs. ``common/`` thereby knows no
component: it names them, it does not import them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

OVERRIDES_HELP = "config overrides as section.key=value (typed: 3, 1e-4, true, null, [a, b])"


def _job_args(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    p.add_argument("--config", "-c", required=config_required, metavar="FILE", help="job YAML (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def _broker_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--run-dir", metavar="DIR", help="write logs, the resolved config and the bound ports here")


def _rollout_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--engine", choices=["hf", "vllm"], help="generation engine (overrides rollout.engine)")
    p.add_argument("--broker", metavar="ADDR", help="broker address, e.g. tcp://10.0.0.1:5555 (overrides broker.address)")
    p.add_argument("--server-index", type=int, default=0, metavar="I", help="index of this server (seed offset, id)")
    p.add_argument("--run-dir", metavar="DIR", help="directory for this server's logs and traces")


def _learner_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--broker", metavar="ADDR", help="broker address (overrides broker.address)")
    p.add_argument("--resume", metavar="auto|PATH", help="resume from the newest checkpoint or a path (checkpoint.resume)")
    p.add_argument("--run-dir", metavar="DIR", help="run directory for metrics, checkpoints and weights")


def _run_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: run.root/run.name-<timestamp>)")
    p.add_argument("--no-status", action="store_true", help="print plain log lines instead of the live status line")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["show", "validate", "docs"], help="show: print the resolved YAML; "
                   "validate: check and say OK; docs: print the Markdown reference of every key")
    p.add_argument("--config", "-c", metavar="FILE", help="job YAML (defaults when omitted)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def _init_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the HF model and tokenizer to")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"],
                   help="tiny: ~0.1M params (tests); small: ~1.4M (demo); base: ~22M (benchmarks)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    p.add_argument("--max-positions", type=int, default=512, help="longest sequence the model supports")


def _init_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="arithmetic", choices=["arithmetic"], help="synthetic task")
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="training split; the held-out split goes to FILE.eval.jsonl")
    p.add_argument("--n", type=int, default=20000, help="training rows (sampled from the non-held-out problems)")
    p.add_argument("--eval-n", type=int, default=500, help="held-out rows, never in the training split")
    p.add_argument("--seed", type=int, default=0, help="seed of the split and sampling")
    p.add_argument("--max-operand", type=int, default=99, help="operands are drawn from 0..max-operand")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, metavar="ADDR", help="broker request address, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--config", "-c", metavar="FILE", help="job YAML, for CURVE client keys (broker.curve)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--json", action="store_true", help="print the status and its metrics as one JSON line")
    p.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S seconds (0 = once)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the broker")


def _keys_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["generate"], help="generate: write CURVE keypairs")
    p.add_argument("dir", metavar="DIR", help="directory for NAME.key (public) and NAME.key_secret files")
    p.add_argument("--clients", nargs="*", default=["client"], metavar="NAME",
                   help="client keypairs to write besides the broker's `server` pair (default: client)")


# name -> (implementation "module:function", one-line help, argument builder)
COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "broker": ("fleetrl.broker.server:main", "run the broker (queue, leases, staleness, spool)", _broker_args),
    "status": ("fleetrl.broker.status:main", "print a broker's queue, leases, rates and clients", _status_args),
    "keys": ("fleetrl.broker.keys:main", "generate CURVE keypairs for the broker and its clients", _keys_args),
    "config": ("fleetrl.common.config_cli:main", "show, validate or document a job config", _config_args),
    "init-model": ("fleetrl.learner.init_model:main", "write a tiny HF model + tokenizer built locally", _init_model_args),
    "init-data": ("fleetrl.common.tasks:main", "write a synthetic prompt set with answers (train + held-out)", _init_data_args),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl",
        description="Asynchronous RL fine-tuning of language models: rollout fleets, a ZeroMQ broker, DeepSpeed learners.",
        epilog="Run `fleetrl COMMAND --help` for the options of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text, add_args) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + "."))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    target, _, _ = COMMANDS[args.command]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    from fleetrl.common.config import ConfigError

    try:
        return int(func(args) or 0)
    except ConfigError as e:
        print(f"fleetrl {args.command}: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
