"""Fault injection for the circuit-breaker bench (``benchmarks/health.py``): a testing aid, off by default.

    FLEETRL_FAULT=lr_spike FLEETRL_FAULT_AT=60 [FLEETRL_FAULT_FOR=10] fleetrl run --config configs/demo.yaml

``FLEETRL_FAULT`` (a comma list) names the faults. Learner faults hit the learner's *state* at step
``FLEETRL_FAULT_AT`` and stay until something restores it (a rollback does): the LR in the optimizer
and scheduler state, the weights after one NaN update. Rollout faults are active while the policy
version a server samples with lies in ``[FLEETRL_FAULT_AT, FLEETRL_FAULT_AT + FLEETRL_FAULT_FOR)``: they
live outside the learner (a reward deployment, a weight sync, a server's sampling settings), so a
rollback does not clear them; they end when that window does (versions keep counting forward through
a rollback), or, with ``FLEETRL_FAULT_FOR_S`` > 0, that many seconds after the process first injected them,
whichever comes first. A fault whose groups the broker refuses (``entropy_collapse`` at a low enough
temperature: log-probs of exactly 0.0) stops the learner, so no version passes: counted only in versions
it would never end, where a real fleet's settings are put right after some time. Every process of a job inherits the environment, so one setting reaches the learner and
the fleet. ``FLEETRL_FAULT_AT`` must be >= 1.

Learner faults:

- ``lr_spike``: from step AT the learning rate (optimizer and scheduler state) is x
  ``FLEETRL_FAULT_LR_FACTOR`` (50): divergence;
- ``nan_grad``: every gradient of step AT is NaN (one non-finite update).

Rollout faults:

- ``nan_reward``: a fraction ``FLEETRL_FAULT_FRACTION`` (0.25) of reward scores are NaN (the scorer sees them);
- ``reward_hack``: the reward pays 1 for a degenerate output: an empty or one-character answer;
- ``stale_fleet``: new weights are received and announced but the engine keeps the weights of the fault's
  start: the fleet's real policy falls ever further behind the learner's version (HF engine);
- ``entropy_collapse``: sampling temperature ``FLEETRL_FAULT_TEMPERATURE`` (0.1) instead of
  ``rollout.temperature``;
- ``corrupt_weights``: each weight load adds noise (``FLEETRL_FAULT_NOISE`` (0.05) x each tensor's std)
  while the server reports the new version: a corrupted sync (HF engine);
- ``engine_dtype``: each weight load rounds the engine's weights through ``FLEETRL_FAULT_DTYPE``
  (float8_e5m2) while the learner trains full precision: engine numerics (HF engine);
- ``poison_server``: only on rollout server ``FLEETRL_FAULT_SERVER`` (index, 0): every group it pushes pays
  -1e6 to every sample and reports every behaviour log-prob as exactly 0.0 (a broken reward deployment and
  engine on one machine).

Production code reaches these through the seam of ``points.py`` (``faults.at`` / ``faults.around``), never
directly. With ``FLEETRL_FAULT`` unset each point costs one truthiness test. Nothing here runs in a normal job.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("fleetrl.faults")

LEARNER_FAULTS = ("lr_spike", "nan_grad")
ROLLOUT_FAULTS = (
    "nan_reward",
    "reward_hack",
    "stale_fleet",
    "entropy_collapse",
    "corrupt_weights",
    "engine_dtype",
    "poison_server",
)
WEIGHT_FAULTS = ("stale_fleet", "corrupt_weights", "engine_dtype")  # applied by WeightFaults.wrap
KINDS = LEARNER_FAULTS + ROLLOUT_FAULTS


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    kinds: frozenset[str] = frozenset()
    at: int = 0
    duration: int = 10
    lr_factor: float = 50.0
    fraction: float = 0.25
    temperature: float = 0.1
    noise: float = 0.05
    dtype: str = "float8_e5m2"
    server: int = 0  # poison_server: the rollout server index it hits
    seconds: float = 0.0  # rollout faults also end this long after this process first injected them (0: never)

    def __post_init__(self):
        unknown = sorted(self.kinds - set(KINDS))
        if unknown:
            raise ValueError(f"FLEETRL_FAULT names unknown fault(s) {unknown}; valid: {', '.join(KINDS)}")
        if self.kinds and self.at < 1:
            raise ValueError(f"FLEETRL_FAULT_AT={self.at}: faults start at a learner step / policy version >= 1")
        if self.duration < 1 or not 0 < self.fraction <= 1 or self.lr_factor <= 0 or self.temperature < 0:
            raise ValueError(
                "FLEETRL_FAULT_FOR must be >= 1, FLEETRL_FAULT_FRACTION in (0, 1], "
                "FLEETRL_FAULT_LR_FACTOR > 0 and FLEETRL_FAULT_TEMPERATURE >= 0"
            )
        if self.seconds < 0:
            raise ValueError(f"FLEETRL_FAULT_FOR_S={self.seconds:g}: seconds must be >= 0 (0: no time bound)")
        if self.noise <= 0:
            raise ValueError(f"FLEETRL_FAULT_NOISE={self.noise}: the noise scale must be > 0")

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def active(self, kind: str, clock: int) -> bool:
        """Whether ``kind`` is injected at ``clock`` (learner step or rollout policy version), and, for a
        rollout fault with ``seconds`` set, less than ``seconds`` after this process first injected it."""
        if not (kind in self.kinds and self.at <= clock < self.at + self.duration):
            return False
        if not self.seconds or kind not in ROLLOUT_FAULTS:
            return True
        now = seconds_clock()
        began = _BEGAN.setdefault(kind, now)
        return now - began < self.seconds

    @classmethod
    def from_env(cls, given: Mapping[str, str] | None = None) -> FaultPlan:
        env: Mapping[str, str] = os.environ if given is None else given
        kinds = frozenset(k.strip() for k in env.get("FLEETRL_FAULT", "").split(",") if k.strip())
        if not kinds:
            return cls()
        return cls(
            kinds,
            int(env.get("FLEETRL_FAULT_AT", "0")),
            int(env.get("FLEETRL_FAULT_FOR", "10")),
            float(env.get("FLEETRL_FAULT_LR_FACTOR", "50")),
            float(env.get("FLEETRL_FAULT_FRACTION", "0.25")),
            float(env.get("FLEETRL_FAULT_TEMPERATURE", "0.1")),
            float(env.get("FLEETRL_FAULT_NOISE", "0.05")),
            env.get("FLEETRL_FAULT_DTYPE", "float8_e5m2"),
            int(env.get("FLEETRL_FAULT_SERVER", "0")),
            float(env.get("FLEETRL_FAULT_FOR_S", "0")),
        )


PLAN = FaultPlan.from_env()
if PLAN:
    log.warning(
        "fault injection is ON (a testing aid): %s from %d for %d steps/versions%s",
        sorted(PLAN.kinds),
        PLAN.at,
        PLAN.duration,
        f" or {PLAN.seconds:g} s" if PLAN.seconds else "",
    )


ROLLOUT_VERSION = 0
"""The policy version this rollout process samples with (``note_version``), the clock of rollout faults."""
_BEGAN: dict[str, float] = {}
"""When this process first injected each time-bounded rollout fault (``seconds_clock()``)."""
seconds_clock: Callable[[], float] = time.monotonic
"""The clock of ``FLEETRL_FAULT_FOR_S`` (tests replace it here, not in the ``time`` module)."""
ROLLOUT_INDEX = 0
"""This rollout process's server index (``note_server``): ``poison_server`` hits one server only."""


def note_version(version: int) -> None:
    global ROLLOUT_VERSION
    ROLLOUT_VERSION = version


def note_server(index: int) -> None:
    global ROLLOUT_INDEX
    ROLLOUT_INDEX = index


def set_plan(plan: FaultPlan) -> None:
    """Replace the plan (tests; processes read theirs from the environment at import)."""
    global PLAN
    PLAN = plan
    _BEGAN.clear()


# ------------------------------------------------------------------------------ learner hooks


def lr_multiplier(step: int) -> float:
    """``lr_spike``: the factor to put into the learner's LR state before step ``step`` (1.0 except at the
    injection step; the factor then stays in the scheduler's base LR until a checkpoint is restored)."""
    return PLAN.lr_factor if PLAN and "lr_spike" in PLAN.kinds and step == PLAN.at else 1.0


def poison_grads(module: Any, step: int) -> list[Any]:
    """``nan_grad``: hooks that turn every gradient of ``module`` NaN during step ``step`` (the injection
    step only); remove them (``handle.remove()``) after the step. An empty list otherwise."""
    if not (PLAN and "nan_grad" in PLAN.kinds and step == PLAN.at):
        return []
    return [p.register_hook(lambda g: g * math.nan) for p in module.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------ rollout hooks


def temperature(default: float, version: int) -> float:
    """``entropy_collapse``: the sampling temperature for a request made at ``version``."""
    return PLAN.temperature if PLAN and PLAN.active("entropy_collapse", version) else default


def is_degenerate(response: str) -> bool:
    """The output ``reward_hack`` pays for: an empty or one-character answer."""
    return len(response.strip()) <= 1


def poison_scores(
    scores: list[list[Any]], responses: list[str], nan_score: Callable[[float], Any], version: int | None = None
) -> None:
    """Rollout reward faults on one scored batch, in place: ``scores[part][sample]``.

    ``reward_hack`` sets every part of a degenerate response to 1.0; ``nan_reward`` replaces the
    scores of every ``1/fraction``-th sample by what ``nan_score(nan)`` makes of a NaN (the scorer's own
    handling of a reward that returned NaN)."""
    if not PLAN:
        return
    version = ROLLOUT_VERSION if version is None else version
    if PLAN.active("reward_hack", version):
        for row in scores:
            for j, text in enumerate(responses):
                if is_degenerate(text):
                    row[j] = 1.0
    if PLAN.active("nan_reward", version):
        every = max(1, round(1 / PLAN.fraction))
        for row in scores:
            for j in range(0, len(row), every):
                row[j] = nan_score(math.nan)


def poison_groups(groups: list[Any]) -> list[Any]:
    """``poison_server``: on the chosen server, while active, each group pays -1e6 to every sample and reports
    every behaviour log-prob as 0.0 (``SampleGroup``s rebuilt; the others returned as they are)."""
    if not (PLAN and PLAN.active("poison_server", ROLLOUT_VERSION) and ROLLOUT_INDEX == PLAN.server):
        return groups
    import msgspec
    import numpy as np

    return [
        msgspec.structs.replace(
            g, rewards=[-1e6] * len(g.rewards), logprobs=np.zeros(len(g.logprobs) // 4, np.float32).tobytes()
        )
        for g in groups
    ]


class WeightFaults:
    """The weight-sync and engine-numerics faults, around an engine's weight load (HF engine: ``engine.model``).
    The load completes and the server reports the new version either way: a silent fault.

    - ``stale_fleet``: while active for the version loaded, the engine's weights go back to those it held
      when the fault began.
    - ``corrupt_weights``: Gaussian noise of ``noise`` x each floating tensor's std is added (seeded by the
      version, so every load is corrupted differently).
    - ``engine_dtype``: every floating tensor is rounded through ``dtype`` and back (e.g. float8 weights
      served against a full-precision learner).
    """

    def __init__(self):
        self.saved: dict[str, Any] | None = None

    def wrap(self, load: Callable[[Any], int | None], version_of: Callable[[], int | None]) -> Callable[[Any], Any]:
        if not PLAN or not PLAN.kinds & set(WEIGHT_FAULTS):
            return load

        def faulty_load(engine: Any) -> int | None:
            pending = version_of()
            stale = "stale_fleet" in PLAN.kinds
            before = (
                {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
                if stale and self.saved is None
                else None
            )
            version = load(engine)
            if version is None:
                return version
            if PLAN.active("stale_fleet", version):
                if self.saved is None:
                    self.saved = before
                engine.model.load_state_dict(self.saved)
                log.warning(
                    "fault stale_fleet: version %s received, the engine keeps the weights of the fault's start", pending
                )
            if PLAN.active("corrupt_weights", version) or PLAN.active("engine_dtype", version):
                _perturb(engine.model, version)
            return version

        return faulty_load


def _perturb(model: Any, version: int) -> None:
    import torch  # only here: this module imports without torch

    gen = torch.Generator().manual_seed(version)
    low = getattr(torch, PLAN.dtype, None)
    if PLAN.active("engine_dtype", version) and not isinstance(low, torch.dtype):
        raise ValueError(f"FLEETRL_FAULT_DTYPE={PLAN.dtype!r} is not a torch dtype (e.g. float8_e5m2, bfloat16)")
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            if PLAN.active("corrupt_weights", version):
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype)
                p.add_(noise * (PLAN.noise * p.detach().float().std().nan_to_num(0.0)).to(p.dtype))
            if PLAN.active("engine_dtype", version):
                p.copy_(p.to(low).to(p.dtype))
    log.warning(
        "fault %s at version %d: the engine's weights differ from the learner's",
        ",".join(k for k in ("corrupt_weights", "engine_dtype") if PLAN.active(k, version)),
        version,
    )
