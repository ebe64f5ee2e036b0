"""Checkpoints that resume a learner exactly, plus an HF-format export a user can serve.

Layout under ``checkpoint.dir`` (default ``<run dir>/checkpoints``)::

    step-00000050/            DeepSpeed state: model, optimizer, scheduler (engine.save_checkpoint)
    step-00000050/meta.json   step, policy version, healthy flag, time — written LAST: a checkpoint
                              without it is incomplete and never resumed from
    step-00000050/hf/         save_pretrained + tokenizer (checkpoint.export_hf); with model.lora the
                              merged model, plus hf/adapter/ (peft save_pretrained)
    step-00000050/critic/     the critic's DeepSpeed state (adv_estimator: gae)

The learner's own state (RNGs, KL controller, metric history, the broker commit point) travels in
DeepSpeed's ``client_state``. ``keep_last`` newest checkpoints are kept, plus the newest one tagged
healthy (the health monitor's rollback target).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fleetrl.common.config.schema import JobConfig

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def tag_of(step: int) -> str:
    return f"step-{step:08d}"


class Checkpointer:
    def __init__(self, cfg: JobConfig, run_dir: Path, rank: int):
        self.cfg, self.rank = cfg, rank
        self.dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"
        self.dir.mkdir(parents=True, exist_ok=True)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return sorted(p.parent for p in self.dir.glob("step-*/meta.json"))

    def meta(self, path: Path) -> dict[str, Any]:
        return json.loads((path / "meta.json").read_text())

    def newest(self, healthy_only: bool = False) -> Path | None:
        for path in reversed(self.complete()):
            if not healthy_only or self.meta(path).get("healthy", False):
                return path
        return None

    def resolve(self, resume: str | None) -> Path | None:
        """``auto`` -> the newest complete checkpoint (or None); a path -> that checkpoint (must be complete)."""
        if not resume:
            return None
        if resume == "auto":
            return self.newest()
        path = Path(resume)
        if not (path / "meta.json").exists():
            raise FileNotFoundError(
                f"checkpoint.resume={resume!r} is not a complete checkpoint (no meta.json); "
                f"use `auto` or one of {[p.name for p in self.complete()][-3:]}"
            )
        return path

    def save(
        self,
        engine,
        step: int,
        client_state: dict[str, Any],
        meta: dict[str, Any],
        export: Callable[[Path], None] | None = None,
        extra: Callable[[Path], None] | None = None,
    ) -> Path:
        """Collective: every rank calls it. Rank 0 writes the export and meta.json, then prunes.

        ``extra(path)`` saves more state into the checkpoint directory before meta.json (the critic).
        With ``model.lora`` only the trainable (adapter) weights and their optimizer state are saved.
        """
        tag = tag_of(step)
        t0 = time.perf_counter()
        engine.save_checkpoint(
            str(self.dir),
            tag=tag,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=self.cfg.model.lora is not None,
        )
        path = self.dir / tag
        if extra is not None:
            extra(path)
        if export is not None and self.cfg.checkpoint.export_hf:
            export(path / "hf")
        if self.rank == 0:
            info = {"step": step, "time": time.time(), "save_s": round(time.perf_counter() - t0, 3), **meta}
            tmp = path / "meta.json.tmp"
            tmp.write_text(json.dumps(info, indent=1))
            tmp.replace(path / "meta.json")
            self.prune()
        log.info("checkpoint %s saved in %.1f s", path, time.perf_counter() - t0)
        return path

    def mark_healthy(self, path: Path, healthy: bool) -> None:
        if self.rank == 0 and (path / "meta.json").exists():
            info = self.meta(path)
            info["healthy"] = healthy
            (path / "meta.json").write_text(json.dumps(info, indent=1))

    def prune(self) -> None:
        done = self.complete()
        keep = set(done[-self.cfg.checkpoint.keep_last :])
        healthy = self.newest(healthy_only=True)
        if healthy is not None:
            keep.add(healthy)
        for path in done:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.dir.glob("step-*"):  # incomplete leftovers older than the newest complete one
            if path.is_dir() and not (path / "meta.json").exists() and done and path.name < done[-1].name:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, engine, path: Path) -> dict[str, Any]:
        """Collective: restore DeepSpeed state from ``path``; returns the learner's client_state."""
        _, client_state = engine.load_checkpoint(
            str(path.parent),
            tag=path.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=self.cfg.model.lora is None,
        )  # LoRA: adapters only
        if client_state is None:
            raise RuntimeError(f"checkpoint {path} could not be loaded by DeepSpeed")
        return client_state


def export_hf(
    model, named_params: Iterable[tuple[str, torch.Tensor]], out: Path, tokenizer_dir: str, rank: int
) -> None:
    """Write ``save_pretrained`` output (safetensors) + the tokenizer files; ``named_params`` are full tensors."""
    state = {name: t.detach().cpu().clone() for name, t in named_params}
    if rank != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state, safe_serialization=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
