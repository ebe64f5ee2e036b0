"""``verifiers``: a verifiers (0.4, ``verifiers.v1``) taskset trained in-process (``rollout.env.verifiers``).

verifiers is an optional extra (``pip install 'fleetrl[verifiers]'``, Python >= 3.11), imported only here and by
``fleetrl verifiers-data``. What is used of it, and how:

- **the tasks**: the taskset named by ``rollout.env.verifiers.taskset`` (an installed module exporting one
  ``vf.Taskset`` subclass in ``__all__``, as verifiers' own loader finds it), built with its config
  (``rollout.env.verifiers.args`` validated against the taskset's ``vf.TasksetConfig`` subclass).
  ``fleetrl verifiers-data`` writes its tasks as the prompt set the broker hands out (``rows``): each row keeps
  the task's data (``vf_task``), and the episode rebuilds the task from it, so the broker, its leases and its
  spool stay what they are for any data set.
- **the rollout**: the chat loop of verifiers' ``null`` harness (the task's system prompt and prompt, then the
  model's reply), run token-in/token-out on fleetrl's engine with the chat codec the ``tool`` environment uses
  (``episode.run_episode``): no HTTP, no harness program, no sandbox.
- **the rubric**: the task's ``@vf.reward`` / ``@vf.metric`` methods and the rewards plugged in its config,
  run by verifiers' own ``Task.score`` on a ``vf.Trace`` of the conversation. The episode's reward is the
  trace's (the weighted sum), its parts the rewards by name (``reward/<name>/mean``, the samples' reward parts);
  the metrics are means (``verifiers/<name>/mean``). A rubric that raises or runs past
  ``rollout.env.verifiers.score_timeout_s`` fails the sample (dropped, counted).

Not supported (refused at start with the key to change): tasks with tool servers (``toolsets``), a runtime
(container or sandbox) or judges (an LLM call), and multi-agent environments.
"""

from __future__ import annotations

import collections
import inspect
import math
import threading
from typing import Any

from fleetrl.common.config import ConfigError
from fleetrl.rollout.envs.base import EnvFailure, EnvSession, Message, StepResult, Task
from fleetrl.rollout.envs.multi import MultiTurnEnvironment, call_with_timeout

KEY = "rollout.env.verifiers"
MISSING = (
    "rollout.env.type=verifiers needs the `verifiers` extra (verifiers 0.4.0, Python >= 3.11): "
    "pip install 'fleetrl[verifiers]' (or choose another rollout.env.type)"
)


def import_vf() -> Any:
    """``verifiers.v1``, or a ConfigError saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f"{MISSING} ({type(e).__name__}: {e})") from None
    return vf


def load_taskset(opts: Any) -> Any:
    """The taskset of ``rollout.env.verifiers`` (its id and args), checked for what runs in-process."""
    vf = import_vf()
    from pydantic import ValidationError

    try:
        config_cls = vf.taskset_config_type(opts.taskset)
    except (ImportError, TypeError, AttributeError, ValueError) as e:
        raise ConfigError(
            f"{KEY}.taskset={opts.taskset!r}: not a verifiers taskset ({e}); name an installed module "
            "that exports one vf.Taskset subclass in __all__"
        ) from None
    try:
        config = config_cls.model_validate({**opts.args, "id": opts.taskset})
    except (ValidationError, ImportError, TypeError, ValueError) as e:  # a plugin the args name may not import
        why = _first_error(e) if isinstance(e, ValidationError) else f"{type(e).__name__}: {e}"
        fields = ", ".join(sorted(config_cls.model_fields))
        raise ConfigError(
            f"{KEY}.args: not a valid {config_cls.__name__} for taskset {opts.taskset!r} ({why}); its fields: {fields}"
        ) from None
    try:
        taskset = vf.load_taskset(config)
    except Exception as e:  # noqa: BLE001 - the taskset's own constructor: name it and the key
        raise ConfigError(f"{KEY}: taskset {opts.taskset!r} failed to load ({type(e).__name__}: {e})") from None
    _check_supported(taskset, opts.taskset)
    return taskset


def _first_error(e: Any) -> str:
    err = e.errors()[0]
    return f"{'.'.join(str(x) for x in err['loc']) or 'args'}: {err['msg']}"


def _check_supported(taskset: Any, name: str) -> None:
    task_cls = type(taskset).task_type()
    why = ""
    if type(taskset).toolsets(taskset.config) or task_cls.toolsets(taskset.config.task):
        why = "it has tool servers (toolsets)"
    elif getattr(task_cls, "NEEDS_CONTAINER", False):
        why = "its tasks need a container runtime"
    elif taskset.config.task.judges:
        why = "its tasks are scored by judges (an LLM call)"
    elif (first := next(iter(taskset), None)) is None:
        why = "it has no tasks"
    elif runtime := needs_runtime(first):
        why = f"its rubric needs a runtime (sandbox) for {', '.join(runtime)}"
    elif not first.hooks("reward"):
        why = "its tasks declare no reward (@vf.reward) to train on"
    elif sync := [fn.__name__ for fn in (*first.hooks("metric"), *first.hooks("reward")) if not _is_async(fn)]:
        why = f"its rubric's {', '.join(sync)} must be `async def` (verifiers awaits every @vf.reward and @vf.metric)"
    if why:
        raise ConfigError(
            f"{KEY}.taskset={name!r}: {why}, which the in-process verifiers environment does not run; "
            "use a taskset whose tasks are a chat prompt scored by @vf.reward methods"
        )


def task_row(task: Any) -> dict[str, Any]:
    """One prompt-set row of a verifiers task: the chat prompt (for reading and `fleetrl eval`), the answer when
    the task data has one, and the task's data (``vf_task``), from which the episode rebuilds the task."""
    data = task.data.model_dump(mode="json")
    answer = data.get("answer")
    return {
        "prompt": prompt_messages(task.data),
        "answer": None if answer is None else str(answer),
        "vf_task": data,
        "vf_key": task.key,
    }


def prompt_messages(data: Any) -> list[Message]:
    """The messages the null harness opens with: the system prompt (its own message), then the prompt."""
    messages: list[Message] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]
    return messages


class RubricStats:
    """Means of the rubric's rewards (by name) and metrics since the last ``take`` (episodes end on the engine's
    thread, metrics are read on the finisher's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: collections.Counter[str] = collections.Counter()
        self._counts: collections.Counter[str] = collections.Counter()

    def add(self, prefix: str, values: dict[str, float]) -> None:
        with self._lock:
            for name, value in values.items():
                self._sums[f"{prefix}/{name}/mean"] += value
                self._counts[f"{prefix}/{name}/mean"] += 1

    def take(self) -> dict[str, float]:
        with self._lock:
            out = {k: self._sums[k] / n for k, n in self._counts.items() if n}
            self._sums, self._counts = collections.Counter(), collections.Counter()
        return out


class VerifiersEnv(MultiTurnEnvironment):
    def __init__(self, cfg: Any, tokenizer: Any):
        self.opts = cfg.rollout.env.verifiers
        self.vf = import_vf()
        self.taskset = load_taskset(self.opts)
        self.task_cls = type(self.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self.rubric = RubricStats()
        super().__init__(cfg, tokenizer)

    def session(self, task: Task) -> EnvSession:
        return VerifiersSession(self)

    def make_task(self, row: dict[str, Any]) -> Any:
        """The verifiers task of a prompt-set row (its ``vf_task`` column, written by ``fleetrl verifiers-data``)."""
        data = row["metadata"].get("vf_task")
        if not isinstance(data, dict):
            raise EnvFailure(
                f"prompt {row['prompt_id']} has no `vf_task` column: the prompt set (data.train) is not a verifiers "
                "export; write it with `fleetrl verifiers-data`"
            )
        try:
            return self.task_cls(self.data_cls.model_validate(data), self.taskset.config.task)
        except Exception as e:  # noqa: BLE001 - a row of another taskset: the sample fails, named
            raise EnvFailure(f"prompt {row['prompt_id']}: not a {self.data_cls.__name__} ({e})") from None

    def example_messages(self) -> list[Message]:
        first = next(iter(self.taskset), None)
        opening = prompt_messages(first.data) if first is not None else [{"role": "user", "content": "a question"}]
        return [*opening, {"role": "assistant", "content": "an answer"}]

    def metrics(self) -> dict[str, float]:
        return {**self.stats.take(), **self.rubric.take()}


class VerifiersSession(EnvSession):
    """One episode: the task rebuilt from its row, one assistant turn, then the task's rubric on the trace."""

    def __init__(self, env: VerifiersEnv):
        self.env = env
        self.task: Any = None
        self.messages: list[Message] = []

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        self.task = self.env.make_task(row)
        self.messages = prompt_messages(self.task.data)
        if not self.messages:
            raise EnvFailure(f"prompt {row['prompt_id']}: the verifiers task has no prompt")
        return self.messages

    async def step(self, message: Message) -> StepResult:
        trace = self.trace(message)
        await call_with_timeout(
            self.task.score, trace, timeout_s=self.env.opts.score_timeout_s, what=f"{self.env.task_cls.__name__}.score"
        )
        rewards = {name: r for name, r in trace.rewards.items() if r is not None}
        if not rewards:
            unscored = ", ".join(trace.rewards) or "none declared"
            raise EnvFailure(f"the verifiers rubric gave no reward ({unscored})")
        total = float(trace.reward)
        if not math.isfinite(total):
            raise EnvFailure(f"the verifiers rubric's reward is not finite ({trace.rewards})")
        parts = {name: float(r.score) for name, r in rewards.items()}
        self.env.rubric.add("reward", parts)
        self.env.rubric.add("verifiers", {k: float(v) for k, v in trace.metrics.items() if v is not None})
        return StepResult(reward=total, done=True, parts=parts)

    def trace(self, reply: Message) -> Any:
        """A ``vf.Trace`` of the conversation (prompt nodes, then the sampled reply), as verifiers' scoring reads it."""
        vf, task = self.env.vf, self.task
        from verifiers.v1.state import state_cls

        nodes = [
            vf.MessageNode(parent=i - 1 if i else None, message=m, sampled=False) for i, m in enumerate(self.messages)
        ]
        nodes.append(
            vf.MessageNode(
                parent=len(nodes) - 1 if nodes else None,
                message=vf.AssistantMessage(content=str(reply.get("content") or "")),
                sampled=True,
            )
        )
        return vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="fleetrl"),
            nodes=nodes,
            is_completed=True,
            ok=True,
        )


def _is_async(fn: Any) -> bool:
    """Whether verifiers can await ``fn``: a coroutine function, or a config-plugged wrapper of one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(inspect.unwrap(fn))


def needs_runtime(task: Any) -> list[str]:
    """The rubric's signals that need a runtime (skipped in-process; `Task.score` logs them)."""
    fns = [*task.hooks("metric"), *task.hooks("reward")]
    return [
        fn.__name__
        for fn in fns
        if (p := inspect.signature(fn).parameters.get("runtime")) is not None and p.default is p.empty
    ]


def verifiers_problems(cfg: Any) -> list[str]:
    """`config validate`'s check of rollout.env.verifiers (nothing for other environment types)."""
    if cfg.rollout.env.type != "verifiers":
        return []
    try:
        load_taskset(cfg.rollout.env.verifiers)
    except ConfigError as e:
        return [str(e)]
    return export_problems(cfg.data.train)


def export_problems(train: str) -> list[str]:
    """data.train, when a local file, is a verifiers export (its rows carry ``vf_task``)."""
    from pathlib import Path

    from fleetrl.common.data.tables import DataError, first_row

    fix = "write the taskset's tasks there with `fleetrl verifiers-data --config JOB.yaml`"
    p = Path(train).expanduser()
    if not p.exists():
        return [f"data.train={train!r} does not exist; {fix}"]
    try:
        row = first_row(p, "data.train") if p.is_file() else None
    except DataError:
        return []  # check_data names it
    if row is not None and "vf_task" not in row:
        return [f"data.train={train!r} is not a verifiers export (its rows have no `vf_task` column); {fix}"]
    return []


def export(opts: Any, out: str, limit: int | None, skip: int = 0) -> int:
    """Write the taskset's tasks ``skip`` to ``skip + limit`` as a prompt set (one ``task_row`` a line); the count."""
    import itertools
    import json
    from pathlib import Path

    taskset = load_taskset(opts)
    if limit is None and not taskset.bounded:
        raise ConfigError(f"{KEY}.taskset={opts.taskset!r} is infinite; set {KEY}.limit (or --limit)")
    stop = None if limit is None else skip + limit
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for task in itertools.islice(taskset, skip, stop):
            f.write(json.dumps(task_row(task)) + "\n")
            n += 1
    if not n:
        raise ConfigError(f"{KEY}.taskset={opts.taskset!r} gave no tasks (skip {skip}, limit {limit})")
    return n


def main(args: Any) -> int:
    """`fleetrl verifiers-data`: the job's verifiers taskset as its prompt set (data.train, or --out)."""
    from fleetrl.common.config import load_config

    cfg = load_config(args.config, list(args.overrides))
    if cfg.rollout.env.type != "verifiers":
        raise ConfigError("fleetrl verifiers-data needs rollout.env.type=verifiers (and rollout.env.verifiers.taskset)")
    out = args.out or cfg.data.train
    limit = args.limit if args.limit is not None else cfg.rollout.env.verifiers.limit
    n = export(cfg.rollout.env.verifiers, out, limit, args.skip)
    print(f"wrote {n} tasks of verifiers taskset {cfg.rollout.env.verifiers.taskset!r} to {out}")
    return 0
