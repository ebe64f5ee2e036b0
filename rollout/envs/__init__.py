"""Environments, looked up by ``rollout.env.type`` (docs/environments.md): how one sample is produced.

    env = create_env(cfg, tokenizer)       # once per rollout server; env.check() at start-up
    task = env.task(prompt)                # once per admitted prompt
    sample = await env.episode(engine, task, params, request_id, trace)   # per sample, on engine.loop

``single_turn`` (one completion), ``tool`` (Python functions as tools), ``user`` (a class by module
path), ``http`` (a remote environment server), ``openai`` (external agents through the endpoint of
``rollout.openai``), ``verifiers`` (a verifiers taskset in-process, scored by its rubric). The registry holds factories that import their module when called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleetrl.common.plugins.registry import Registry
from fleetrl.rollout.envs.base import (
    EnvFailure,
    Environment,
    EnvSession,
    EnvStats,
    EnvTimeout,
    Episode,
    StepResult,
    Task,
    TemplateMismatch,
)

if TYPE_CHECKING:
    from fleetrl.common.config.schema import JobConfig

__all__ = [
    "ENVS",
    "EnvFailure",
    "EnvSession",
    "EnvStats",
    "EnvTimeout",
    "Environment",
    "Episode",
    "StepResult",
    "Task",
    "TemplateMismatch",
    "create_env",
]

ENVS: Registry[Callable[..., Environment]] = Registry("environment", config_key="rollout.env.type")


@ENVS.register("single_turn")
def _single_turn(cfg: JobConfig, tokenizer: Any) -> Environment:
    from fleetrl.rollout.envs.single_turn import SingleTurnEnv

    return SingleTurnEnv(cfg, tokenizer)


@ENVS.register("tool")
def _tool(cfg: JobConfig, tokenizer: Any) -> Environment:
    from fleetrl.rollout.envs.tool_env import ToolEnv

    return ToolEnv(cfg, tokenizer)


@ENVS.register("user")
def _user(cfg: JobConfig, tokenizer: Any) -> Environment:
    from fleetrl.rollout.envs.user_env import UserEnv

    return UserEnv(cfg, tokenizer)


@ENVS.register("http")
def _http(cfg: JobConfig, tokenizer: Any) -> Environment:
    from fleetrl.rollout.envs.http import HttpEnv

    return HttpEnv(cfg, tokenizer)


@ENVS.register("openai")
def _openai(cfg: JobConfig, tokenizer: Any) -> Environment:
    from fleetrl.rollout.endpoint.sessions import AgentEnv

    return AgentEnv(cfg, tokenizer)


@ENVS.register("verifiers")
def _verifiers(cfg: JobConfig, tokenizer: Any) -> Environment:
    from fleetrl.rollout.envs.verifiers_env import VerifiersEnv

    return VerifiersEnv(cfg, tokenizer)


def create_env(cfg: JobConfig, tokenizer: Any) -> Environment:
    """The environment of ``rollout.env.type``, checked (the chat template) before it is returned."""
    env = ENVS[cfg.rollout.env.type](cfg, tokenizer)
    env.check()
    return env
