"""Process and model set-up of a learner rank: torch.distributed through DeepSpeed, devices, dtypes,
the policy and reference models, the DeepSpeed engine with a torch AdamW and an LR schedule.

Facts this module works around (measured on CPU machines here):
- DeepSpeed's shm comm op JIT-compiles for ~40 s on the first ``init_distributed`` unless
  ``deepspeed.comm.torch.build_shm_op`` is replaced (through ``sys.modules``: an ``import ... as`` binds
  a different module object).
- An optimizer declared in the DeepSpeed config JIT-builds for ~80 s: we pass a torch ``AdamW``.
- A single process without a launcher needs MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK, or
  DeepSpeed looks for mpi4py.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.net import free_port
from fleetrl.common.telemetry.startup import STARTUP

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: JobConfig) -> Dist:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) via DeepSpeed; works without a launcher."""
    STARTUP.mark("python+imports")
    if "RANK" not in os.environ:  # a plain `fleetrl learner`: one process, no launcher
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    use_cuda = cfg.learner.device == "cuda" or (cfg.learner.device == "auto" and torch.cuda.is_available())
    if not use_cuda:  # say so, rather than have DeepSpeed warn that it could not detect an accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 - the module object whose attribute we replace below

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if cfg.learner.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("learner.device=cuda but no CUDA device is visible; set learner.device=cpu or auto")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", verbose=False)
    STARTUP.mark("torch.distributed")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return Dist(rank, world, local_rank, device)


def train_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    if cfg.learner.precision == "bf16" or (cfg.learner.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def load_causal_lm(path: str, cfg: JobConfig, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    STARTUP.mark("model")
    return model


class BudgetClock:
    """Training wall time against ``learner.max_minutes``: the share of the budget used, which ends the run
    when it reaches 1 (``GracefulStop.agreed``) and which ``learner.lr_decay_by: time`` decays over.

    It starts when training starts (after a resume too, like the deadline: a resumed run trains
    ``max_minutes`` more). ``fraction`` is what the ranks agreed at the top of the step (``GracefulStop.agreed``
    takes the largest rank's), so every rank steps with the same LR."""

    def __init__(self, max_minutes: float | None):
        self.budget_s = 60.0 * max_minutes if max_minutes else math.inf
        self.started: float | None = None
        self.fraction = 0.0

    def start(self) -> None:
        self.started = time.monotonic()

    def local_fraction(self) -> float:
        """This rank's fraction of the budget used (0 before the start or without a budget)."""
        if self.started is None or math.isinf(self.budget_s):
            return 0.0
        return (time.monotonic() - self.started) / self.budget_s


def lr_lambda(cfg: JobConfig, clock: BudgetClock | None = None):
    """Multiplier of the peak LR at each learner step: linear warmup, then constant / linear / cosine decay.

    The scheduler counts optimizer steps; a learner step takes ``algorithm.optimizer_steps`` of them
    (``ppo_epochs x mini_batches`` for RL, one for DPO), so warmup and decay are measured in learner
    steps, as `learner.total_steps` is. With ``learner.lr_decay_by: time`` the decay's progress is
    ``clock.fraction``, the share of ``max_minutes`` used (0 all along without ``max_minutes``).
    """
    lc = cfg.learner
    total, warm, floor = lc.total_steps, lc.warmup_steps, lc.min_lr_ratio
    per_step = cfg.algorithm.optimizer_steps(lc)
    by_time = clock if lc.lr_decay_by == "time" else None
    if by_time is not None and lc.lr_schedule != "constant" and not lc.max_minutes:
        log.warning(
            "learner.lr_decay_by=time decays the learning rate over learner.max_minutes, which is not set: the "
            "learning rate stays at its peak; set learner.max_minutes, or learner.lr_decay_by=steps"
        )

    def factor(optimizer_step: int) -> float:
        step = optimizer_step // per_step
        if warm and step < warm:
            return (step + 1) / warm
        if lc.lr_schedule == "constant":
            return 1.0
        if lc.lr_decay_by == "time":
            progress = by_time.fraction if by_time is not None else 0.0
        else:
            progress = min(1.0, (step - warm) / max(1, total - warm))
        decay = 1.0 - progress if lc.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * decay

    return factor


def deepspeed_config(cfg: JobConfig, dtype: torch.dtype, train: bool = True) -> dict[str, Any]:
    """The DeepSpeed config: ZeRO stage, precision, clipping; micro-batching is ours (unmanaged)."""
    zero: dict[str, Any] = {"stage": cfg.learner.zero_stage}
    if cfg.learner.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=0)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # we run a variable number of micro-batches, then step()
        "zero_optimization": zero,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": dtype == torch.bfloat16},
    }
    if train:
        ds["gradient_clipping"] = cfg.learner.grad_clip
    return ds


def build_engine(
    model: torch.nn.Module,
    cfg: JobConfig,
    dtype: torch.dtype,
    lr: float | None = None,
    params: list[torch.nn.Parameter] | None = None,
    clock: BudgetClock | None = None,
):
    """Wrap a trainable model in a DeepSpeed engine with torch AdamW and the LR schedule (``clock``: the
    training budget, for ``learner.lr_decay_by: time``)."""
    import deepspeed

    trainable = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=lr or cfg.learner.lr, betas=tuple(cfg.learner.betas), weight_decay=cfg.learner.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, clock))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(cfg, dtype),
        model_parameters=trainable,
    )
    if cfg.learner.zero_stage == 0 and engine.dp_world_size == 1:
        engine.enable_backward_allreduce = False  # one rank: the gradient "all-reduce" only flattens and copies
    STARTUP.mark("deepspeed")
    return engine, optimizer, scheduler


def build_frozen(model: torch.nn.Module, cfg: JobConfig, dtype: torch.dtype, device: torch.device):
    """A frozen model (the KL reference): sharded like the policy under ZeRO-3, else a plain module."""
    model.requires_grad_(False)
    model.eval()
    if cfg.learner.zero_stage == 3:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=deepspeed_config(cfg, dtype, train=False))
        engine.eval()
        return engine
    return model.to(device)


def trainable_module(engine) -> torch.nn.Module:
    return getattr(engine, "module", engine)


def param_specs(module: torch.nn.Module):
    """(name, full shape, dtype) of every parameter, tied ones once, in named_parameters order."""
    from fleetrl.common.messages import ParamSpec

    return [
        ParamSpec(name=n, shape=list(getattr(p, "ds_shape", p.shape)), dtype=str(p.dtype).removeprefix("torch."))
        for n, p in module.named_parameters()
    ]


def iter_full_params(module: torch.nn.Module, zero_stage: int, bucket_bytes: int = 256 << 20):
    """Yield (name, full tensor) for every parameter; under ZeRO-3 gathers a bucket at a time.

    Collective under ZeRO-3: every rank must consume the whole iterator.
    """
    named = list(module.named_parameters())
    if zero_stage != 3:
        for name, p in named:
            yield name, p.detach()
        return
    import deepspeed

    chunk, size = [], 0
    for name, p in named:
        chunk.append((name, p))
        size += p.ds_numel * p.element_size()
        if size >= bucket_bytes:
            yield from _gathered(chunk, deepspeed)
            chunk, size = [], 0
    if chunk:
        yield from _gathered(chunk, deepspeed)


def _gathered(chunk, deepspeed):
    with deepspeed.zero.GatheredParameters([p for _, p in chunk], modifier_rank=None):
        for name, p in chunk:
            yield name, p.detach()
