"""Generation engines, looked up by `rollout.engine`: ``hf`` (transformers, CPU or GPU) and ``vllm``
(vLLM's async engine, GPU or its CPU backend). The interface is in `base.py` (docs/rollout.md):

    engine = create_engine(cfg.rollout.engine, cfg.model, cfg.rollout, device="cpu", seed=0)
    out = await engine.generate(Request(prompt_ids, SamplingParams.from_config(cfg.rollout)))  # on engine.loop
    groups = engine.generate_batch(prompts, params, n=8)  # from synchronous code

The registry holds small factories that import their implementation only when called, so importing
this package loads neither torch nor transformers nor vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fleetrl.common.plugins.registry import Registry
from fleetrl.rollout.engines.base import INFLIGHT_MODES, Engine
from fleetrl.rollout.engines.event_loop import EngineLoop
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.engines.weight_files import ParamSpec

if TYPE_CHECKING:
    from fleetrl.common.config.schema import ModelConfig, RolloutConfig

__all__ = [
    "ENGINES",
    "INFLIGHT_MODES",
    "Engine",
    "EngineLoop",
    "Generation",
    "ParamSpec",
    "Request",
    "SamplingParams",
    "create_engine",
]

EngineFactory = Callable[..., Engine]
ENGINES: Registry[EngineFactory] = Registry("generation engine", config_key="rollout.engine")


@ENGINES.register("hf")
def _hf(
    model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str, seed: int, num_threads: int | None = None
) -> Engine:
    from fleetrl.rollout.engines.hf import HFEngine

    return HFEngine(model_cfg, rollout_cfg, device, seed, num_threads=num_threads)


@ENGINES.register("vllm")
def _vllm(
    model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str, seed: int, num_threads: int | None = None
) -> Engine:
    from fleetrl.rollout.engines.vllm import VllmEngine

    return VllmEngine(model_cfg, rollout_cfg, device, seed)


def create_engine(
    name: str,
    model_cfg: ModelConfig,
    rollout_cfg: RolloutConfig,
    device: str,
    seed: int,
    num_threads: int | None = None,
) -> Engine:
    """Build the engine registered as ``name``; an unknown name raises listing the valid ones.

    ``device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``. ``seed`` seeds sampling when a call's
    `SamplingParams.seed` is None. ``num_threads`` sets torch's CPU threads (``hf`` only; None
    leaves the process setting alone).
    """
    return ENGINES[name](model_cfg, rollout_cfg, device, seed, num_threads=num_threads)
