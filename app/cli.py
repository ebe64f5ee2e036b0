"""The `fleetrl` command line.

Every sub-command is declared here (so `fleetrl X --help` works without importing torch) and maps to
a ``module:function`` that is imported only when the command runs. ``common/`` thereby knows no
component: it names them, it does not import them.

A mistake in what the user gave (a config key, a file, a data row, a reward function, a registry
name) is one line on stderr naming the key and the fix, exit code 2; ``--debug`` (or
``FLEETRL_DEBUG=1``, which `fleetrl run` passes to its children) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

OVERRIDES_HELP = "config overrides as section.key=value (typed: 3, 1e-4, true, null, [a, b])"
DEBUG_HELP = "show the traceback of an error instead of one line (also FLEETRL_DEBUG=1)"


def _job_args(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    p.add_argument("--config", "-c", required=config_required, metavar="FILE", help="job YAML (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def _broker_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--run-dir", metavar="DIR", help="write logs, the resolved config and the bound ports here")


def _rollout_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--engine", choices=["hf", "vllm"], help="generation engine (overrides rollout.engine)")
    p.add_argument(
        "--broker", metavar="ADDR", help="broker address, e.g. tcp://10.0.0.1:5555 (overrides broker.address)"
    )
    p.add_argument("--server-index", type=int, default=0, metavar="I", help="index of this server (seed offset, id)")
    p.add_argument("--run-dir", metavar="DIR", help="directory for this server's logs and traces")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="HF model directory to evaluate (default: model.path of --config)")
    p.add_argument(
        "--data",
        metavar="FILE",
        help="prompts with answers: .jsonl/.json/.parquet/.csv, a save_to_disk "
        "directory or a cached datasets name (default: data.eval)",
    )
    p.add_argument("--n", type=int, metavar="N", help="evaluate the first N rows (default: all)")
    p.add_argument(
        "--k", type=int, default=1, metavar="K", help="sampled pass@K besides greedy accuracy (0 = greedy only)"
    )
    p.add_argument(
        "--samples", type=int, metavar="S", help="samples per prompt for pass@K (default: K; more = less variance)"
    )
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default: rollout.temperature)")
    p.add_argument("--max-new-tokens", type=int, metavar="M", help="longest response (default: rollout.max_new_tokens)")
    p.add_argument("--prompt-key", metavar="COL", help="column of the prompt (default: data.prompt_key, `prompt`)")
    p.add_argument(
        "--answer-key", metavar="COL", help="column of the ground truth (default: data.answer_key, `answer`)"
    )
    p.add_argument(
        "--reward", choices=["exact", "math"], help="reward that decides correctness (default: rollout.rewards)"
    )
    p.add_argument(
        "--success",
        type=float,
        metavar="R",
        help="a response is correct when its reward >= R (default: "
        "1.0 for exact/math rewards, required for any other); printed with the results",
    )
    p.add_argument("--device", metavar="DEV", help="cpu, cuda or auto (default: rollout.device)")
    p.add_argument("--batch-size", type=int, default=32, metavar="B", help="prompts generated together")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--out", metavar="FILE.json", help="write the metrics and per-row results as JSON")
    _job_args(p, config_required=False)


def _learner_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--broker", metavar="ADDR", help="broker address (overrides broker.address)")
    p.add_argument(
        "--resume", metavar="auto|PATH", help="resume from the newest checkpoint or a path (checkpoint.resume)"
    )
    p.add_argument("--run-dir", metavar="DIR", help="run directory for metrics, checkpoints and weights")


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="job YAML (see configs/); with --resume: RUN_DIR/config.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--run-dir", metavar="DIR", help="run directory (default: run.root/run.name-<timestamp>)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest checkpoint, with its config.yaml (overrides apply on top)",
    )
    p.add_argument("--no-status", action="store_true", help="print plain log lines instead of the live status line")


def _config_args(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (
        ("show", "print the resolved YAML"),
        (
            "validate",
            "check the config and what it names (files, model and data, reward functions, "
            "chat template) before anything starts; one line per problem, else OK",
        ),
    ):
        sub = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        sub.add_argument("--config", "-c", metavar="FILE", help="job YAML (defaults when omitted)")
        sub.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    actions.add_parser("docs", help="print the Markdown reference of every key")


def _init_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the HF model and tokenizer to")
    p.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "tiny32", "small", "base", "q05b"],
        help="tiny: ~0.1M params (tests); small: ~1.23M (demo); base: ~22M (benchmarks)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    p.add_argument("--max-positions", type=int, default=512, help="longest sequence the model supports")


def _init_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--task",
        default="arithmetic",
        choices=["arithmetic", "arithmetic-preference", "calc"],
        help="synthetic task: arithmetic (prompt, answer), arithmetic-preference (prompt, chosen, "
        "rejected: the correct sum preferred over a wrong one, for offline DPO) or calc (products of "
        "two-digit numbers with a calc tool; training rows carry the tool conversation for the warm start)",
    )
    p.add_argument(
        "--out", required=True, metavar="FILE.jsonl", help="training split; the held-out split goes to FILE.eval.jsonl"
    )
    p.add_argument("--n", type=int, default=20000, help="training rows (sampled from the non-held-out problems)")
    p.add_argument("--eval-n", type=int, default=500, help="held-out rows, never in the training split")
    p.add_argument("--seed", type=int, default=0, help="seed of the split and sampling")
    p.add_argument("--max-operand", type=int, default=99, help="operands are drawn from 0..max-operand")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--broker",
        required=True,
        metavar="ADDR|RUN_DIR",
        help="broker request address, e.g. tcp://127.0.0.1:5555, or a run directory (its broker.json)",
    )
    p.add_argument("--config", "-c", metavar="FILE", help="job YAML, for CURVE client keys (broker.curve)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--json", action="store_true", help="print the status and its metrics as one JSON line")
    p.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S seconds (0 = once)")
    p.add_argument("--target", default="", metavar="CLIENT_ID", help="quarantine / release: the rollout server")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the broker")


def _keys_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["generate"], help="generate: write CURVE keypairs and the broker's allowlist")
    p.add_argument(
        "dir", metavar="DIR", help="directory for NAME.key / NAME.key_secret and the allowlist DIR/clients/<role>/"
    )
    for role, default in (("rollout", "rollout"), ("learner", "learner"), ("operator", "operator"), ("monitor", None)):
        p.add_argument(
            f"--{role}",
            nargs="*",
            metavar="NAME",
            help=f"identities of {role} keys (default: {default or 'none'}); a client's ids start with its identity",
        )


def _control_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["pause", "resume", "stop", "discard", "quarantine", "release"],
        help="pause/resume leasing, stop the fleet (resume undoes it), discard a closed range of versions, "
        "quarantine a rollout server (--target) or release it",
    )
    p.add_argument(
        "--broker",
        required=True,
        metavar="ADDR|RUN_DIR",
        help="broker request address, e.g. tcp://127.0.0.1:5555, or a run directory (its broker.json)",
    )
    p.add_argument("--config", "-c", metavar="FILE", help="job YAML, for the operator's CURVE key (broker.curve)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.add_argument("--reason", default="", help="why (goes to the announcement and the broker's audit log)")
    p.add_argument("--min-version", type=int, metavar="V", help="discard: the range's first version")
    p.add_argument("--max-version", type=int, metavar="V", help="discard: its last version (at most the current one)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the broker")


def _sft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="HF model directory to start from")
    p.add_argument("--data", required=True, metavar="F.jsonl", help="training rows with prompt and answer")
    p.add_argument("--eval-data", required=True, metavar="F.jsonl", help="held-out rows for the early stop")
    p.add_argument("--out", required=True, metavar="DIR", help="where the warm-started model is written")
    p.add_argument("--target-acc", type=float, default=0.25, help="stop once held-out greedy accuracy reaches this")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--batch-size", type=int, default=64, help="rows per step")
    p.add_argument("--max-steps", type=int, default=20000, help="hard step limit")
    p.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    p.add_argument("--eval-n", type=int, default=200, help="held-out rows per evaluation")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=10.0,
        help="stop after this long (loading and evaluations included) even below the target",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of init order and batches")
    p.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help="job YAML: with a multi-turn rollout.env, the early stop "
        "measures whole episodes in that environment (rows with `messages` train on conversations)",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory traced with telemetry.exporter=jsonl")
    p.add_argument("--group", metavar="ID", help="group id (or a unique prefix) whose timeline to print")
    p.add_argument("--n", type=int, default=10, metavar="N", help="without --group: list the latest N groups")


LAUNCHERS = {
    "slurm": "fleetrl.app.launch.slurm:main",
    "ray": "fleetrl.app.launch.ray_job:main",
    "k8s": "fleetrl.app.launch.k8s:main",
}


def _launch_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="engine", metavar="ENGINE", required=True)
    slurm = sub.add_parser(
        "slurm", help="render an sbatch job (broker, rollout srun steps, torchrun learners) and submit it"
    )
    slurm.add_argument(
        "--add-rollout", type=int, metavar="N", help="submit N more rollout servers that join the job in --run"
    )
    slurm.add_argument("--run", metavar="RUN_DIR", help="with --add-rollout: the run directory of the running job")
    ray = sub.add_parser(
        "ray", help="run the job as Ray actors: broker, rollout servers (restarted), learner ranks (PACK)"
    )
    ray.add_argument(
        "--address", metavar="ADDR", help="Ray cluster to join, e.g. auto or ray://head:10001 (cluster.ray.address)"
    )
    ray.add_argument(
        "--add-rollout", type=int, metavar="N", help="start N more rollout actors that join the job in --run"
    )
    ray.add_argument("--run", metavar="RUN_DIR", help="with --add-rollout: the run directory of the running job")
    k8s = sub.add_parser("k8s", help="render Kubernetes manifests: broker, rollout Deployment, learner indexed Job")
    k8s.add_argument("--out", metavar="FILE.yaml", help="write the manifests here (default: RUN/launch/k8s.yaml)")
    for name, parser in (("slurm", slurm), ("ray", ray), ("k8s", k8s)):
        parser.set_defaults(target=LAUNCHERS[name])
        parser.add_argument("--config", "-c", metavar="FILE", help="job YAML with a cluster: section")
        parser.add_argument(
            "--run-dir",
            metavar="DIR",
            help="run directory on shared storage (default: cluster.run_dir, run.dir, else run.root/run.name)",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="write the rendered files and the resolved config; start or submit nothing"
            if name != "k8s"
            else "render only (the only mode: apply with kubectl)",
        )
        parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


# name -> (implementation "module:function", one-line help, argument builder)
def _verifiers_data_args(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--out", metavar="FILE.jsonl", help="where to write the prompt set (default: data.train)")
    p.add_argument("--limit", type=int, help="tasks to write (default: rollout.env.verifiers.limit, else all)")
    p.add_argument("--skip", type=int, default=0, help="tasks to skip first (e.g. a held-out set written apart)")


COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "broker": ("fleetrl.broker.server.service:main", "run the broker (queue, leases, staleness, spool)", _broker_args),
    "rollout": ("fleetrl.rollout.server:main", "run one rollout server (generate, score, push groups)", _rollout_args),
    "eval": ("fleetrl.rollout.eval:main", "greedy accuracy and pass@k of a model on a prompt set", _eval_args),
    "status": ("fleetrl.broker.client.status:main", "print a broker's queue, leases, rates and clients", _status_args),
    "keys": ("fleetrl.broker.security.keys:main", "generate CURVE keypairs for the broker and its clients", _keys_args),
    "control": (
        "fleetrl.broker.client.operator:main",
        "as an operator: pause, resume, stop the fleet or discard versions",
        _control_args,
    ),
    "learner": (
        "fleetrl.app.entries:learner",
        "run a learner rank (also under torchrun -m fleetrl.app.learner)",
        _learner_args,
    ),
    "sft": ("fleetrl.app.entries:sft", "supervised warm start, stopped at a target held-out accuracy", _sft_args),
    "run": ("fleetrl.app.launch.run:main", "start a whole job on this machine: broker, rollouts, learner", _run_args),
    "report": ("fleetrl.learner.report:main", "plot a run's metrics into RUN_DIR/report.html", _report_args),
    "trace": (
        "fleetrl.app.trace_cli:main",
        "print the span timeline of one group from a run's jsonl traces",
        _trace_args,
    ),
    "launch": (
        "",
        "place a job across machines with Slurm, Ray or Kubernetes (`fleetrl launch ENGINE -h`)",
        _launch_args,
    ),
    "config": ("fleetrl.app.config_cli:main", "show, validate or document a job config", _config_args),
    "init-model": (
        "fleetrl.learner.init_model:main",
        "write a tiny HF model + tokenizer built locally",
        _init_model_args,
    ),
    "verifiers-data": (
        "fleetrl.rollout.envs.verifiers_env:main",
        "write the job's verifiers taskset (rollout.env.verifiers) as its prompt set",
        _verifiers_data_args,
    ),
    "init-data": (
        "fleetrl.common.data.tasks:main",
        "write a synthetic prompt set with answers (train + held-out)",
        _init_data_args,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl",
        description="Asynchronous RL fine-tuning of language models: rollout fleets, a ZeroMQ broker, DeepSpeed learners.",
        epilog="Run `fleetrl COMMAND --help` for the options of one command.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text, add_args) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        add_args(cmd)
        if name != "config":  # its actions take it
            cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "what you gave is wrong" and carry a message naming the key to change."""
    from fleetrl.common.config import ConfigError
    from fleetrl.common.plugins.registry import RegistryError
    from fleetrl.common.plugins.userfn import FunctionRefError

    return ConfigError, RegistryError, FunctionRefError


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, letting ``key=value`` overrides sit anywhere after the command (also after options)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    debug = getattr(args, "debug", False) or os.environ.get("FLEETRL_DEBUG", "") not in ("", "0")
    if debug:
        os.environ["FLEETRL_DEBUG"] = "1"  # children of `fleetrl run` show tracebacks too
    os.umask(job_umask(args))  # 077 unless run.file_access says otherwise (keys, spool, weights: owner-only anyway)
    job_python_path(args)  # the job's run.python_path on sys.path, where `pkg.module:function` user code is found
    target = getattr(args, "target", None) or COMMANDS[args.command][0]  # `launch ENGINE` sets its own
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(args) or 0)
    except user_errors() as e:
        if debug:
            raise
        print(f"fleetrl {args.command}: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


UMASKS = {"owner": 0o077, "group": 0o027, "all": 0o022}  # run.file_access


def job_setting_of(args: argparse.Namespace, key: str):
    """One dotted key of the job this command runs (its file and overrides, or a resumed run's config.yaml), read
    before the command starts; None when unset or unreadable here (the command itself reports config errors)."""
    config = getattr(args, "config", None)
    resume = getattr(args, "resume", None)
    if not config and resume and os.path.isfile(os.path.join(str(resume), "config.yaml")):
        config = os.path.join(str(resume), "config.yaml")
    if not config and not getattr(args, "overrides", None):
        return None
    from fleetrl.common.config.names import job_setting

    return job_setting(config, list(getattr(args, "overrides", None) or []), key)


def job_umask(args: argparse.Namespace) -> int:
    """The umask of the job this command runs, from its run.file_access; owner-only when it names none."""
    access = job_setting_of(args, "run.file_access")
    return UMASKS.get(access, UMASKS["owner"]) if isinstance(access, str) else UMASKS["owner"]


def job_python_path(args: argparse.Namespace) -> None:
    """Append the job's run.python_path folders to sys.path (relative ones from the working directory)."""
    folders = job_setting_of(args, "run.python_path")
    if isinstance(folders, list) and folders:
        from fleetrl.common.plugins.userfn import on_path

        for folder in folders:
            if isinstance(folder, str) and folder:
                on_path(folder)


def first_line(error: BaseException) -> str:
    """``config error: ...`` for config problems (one line per problem where it lists several: every unknown
    key, every placement error); the message of others, on one line."""
    from fleetrl.common.config import ConfigError

    if isinstance(error, ConfigError):
        lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
        return "config error: " + "\n  ".join(lines)
    return " ".join(str(error).split())


if __name__ == "__main__":
    sys.exit(main())
