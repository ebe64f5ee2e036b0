"""What every generation engine shares: sampling parameters, the `Generation` record, the `Engine`
interface, and the helpers both engines use (stop handling, weight validation, safetensors reading).

Behaviour log-prob convention (the learner computes the same): for a sampled token ``y_t``,

    logp_t = log_softmax(z_t / T)[y_t]        z_t: raw logits over the FULL vocabulary, T: temperature

taken before top-k / top-p filtering, which only decide what may be sampled. ``T == 0`` means greedy
decoding, whose log-probs are taken at ``T = 1``.

This module imports no torch at import time: the rollout server's light modules and the CPU test
collection can import `SamplingParams` and `Generation` without it.
"""

from __future__ import annotations

import abc
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    import torch

    from fleetrl.common.config.schema import RolloutConfig

ParamSpec = tuple[str, tuple[int, ...], "torch.dtype"]


@dataclass(frozen=True)
class SamplingParams:
    """How one `Engine.generate` call samples. ``temperature == 0`` is greedy; ``top_k == 0`` is off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # Lists from configs are accepted and frozen, so that the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig) -> SamplingParams:
        """The `rollout` section's sampling settings; the seed stays with the engine (None here)."""
        return cls(
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop=tuple(rollout_cfg.stop),
            stop_token_ids=tuple(rollout_cfg.stop_token_ids),
        )


@dataclass
class Generation:
    """One sampled response.

    token_ids: the sampled tokens, including the eos / stop token (or the token completing a stop
        string) that ended the response; the learner trains on all of them.
    logprobs: behaviour log-prob of each token in ``token_ids`` (see the module docstring).
    finish_reason: ``"stop"`` (eos, stop id or stop string) or ``"length"`` (max_new_tokens or the
        model's context length).
    text: the decoded response for rewards: special tokens skipped, a final stop token not decoded,
        cut before the first stop string.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


class Engine(abc.ABC):
    """A generation engine of one rollout server: samples groups, takes new weights in place."""

    tokenizer: object

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n: int) -> list[list[Generation]]:
        """``n`` samples for each prompt: ``out[i][j]`` is sample ``j`` of ``prompt_ids[i]``."""

    @abc.abstractmethod
    def param_specs(self) -> list[ParamSpec]:
        """(name, shape, dtype) of each distinct weight tensor, in state_dict order (HF names).

        Tied aliases (``lm_head.weight`` when embeddings are tied) are not listed but are accepted by
        `update_weights`, so a sender may send either its full state_dict or exactly these.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given weights in place. Every name and shape is checked before anything is copied:
        an unknown name or a wrong shape raises ``ValueError`` and leaves all weights unchanged."""

    @abc.abstractmethod
    def load_weights_from_dir(self, path: str) -> None:
        """Load every weight from the safetensors file(s) of a HF model directory (same checks)."""

    def close(self) -> None:
        """Release the model and its memory. The engine is unusable afterwards."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ stopping


def eos_token_ids(tokenizer, generation_eos: int | list[int] | None, params: SamplingParams) -> list[int]:
    """Token ids that end a response: the tokenizer's eos, the model's generation-config eos
    (an int or a list), and ``params.stop_token_ids``; sorted, without duplicates."""
    ids = set(params.stop_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(generation_eos)
    return sorted(ids)


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest occurrence of any stop string in ``text``, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def stop_window(stops: Sequence[str]) -> int:
    """Trailing tokens whose text must contain a stop string completed by the newest token.

    Every non-special token of a byte-level vocabulary is at least one byte, so a stop string of b
    bytes spans at most b tokens, plus up to 3 for a multi-byte character cut at the window's
    start. (A special token inside a stop string can still hide it from the window; the final
    full-text pass in the engine catches that case.)
    """
    return max(len(s.encode("utf-8")) for s in stops) + 3


# ------------------------------------------------------------------------------------- weights


def state_specs(state: dict[str, torch.Tensor]) -> tuple[list[ParamSpec], dict[str, str]]:
    """Specs of the distinct tensors of a state_dict (taken with ``keep_vars=True``), in its order,
    and the tied aliases: alias name -> first name of the same tensor (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` when embeddings are tied)."""
    first: dict[int, str] = {}
    specs, aliases = [], {}
    for name, tensor in state.items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
            specs.append((name, tuple(tensor.shape), tensor.dtype))
    return specs, aliases


def check_named_shapes(
    named: Sequence[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]], where: str
) -> None:
    """Raise ``ValueError`` naming the first unknown name or wrong shape in ``named``."""
    for name, shape in named:
        if name not in expected:
            close = difflib.get_close_matches(name, list(expected), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where}: unknown weight {name!r}{hint}; send the model's own (HF) names, see "
                "Engine.param_specs(). No weight was changed."
            )
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(
                f"{where}: weight {name!r} has shape {tuple(shape)} but the model expects "
                f"{tuple(expected[name])}. No weight was changed."
            )


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a HF model directory: the shards named by
    ``model.safetensors.index.json``, else ``model.safetensors``, else every ``*.safetensors``."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"weights directory {str(root)!r} does not exist")
    index = root / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    single = root / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(root)!r} (expected model.safetensors or a sharded index)")
    return files


def safetensors_shapes(files: Sequence[Path]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in ``files``, read from the headers only (no tensor data)."""
    from safetensors import safe_open

    shapes = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            shapes += [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
    return shapes


def missing_weights(specs: Sequence[ParamSpec], names: Iterable[str], aliases: dict[str, str]) -> list[str]:
    """Distinct weights of ``specs`` that neither their own name nor a tied alias in ``names`` covers."""
    covered = {aliases.get(n, n) for n in names}
    return [name for name, _, _ in specs if name not in covered]
