"""Inside every vLLM worker: the weight receiver of the `vllm` engine (docs/weight_sync.md).

vLLM mixes `FleetrlWorkerExtension` into its worker class (``worker_extension_cls``), in the
process that owns the model (the engine-core process on CPU, one process per GPU on CUDA), so this
module must be importable there (fleetrl installed, or on ``PYTHONPATH``). The rollout server calls
its ``fleetrl_*`` methods through ``collective_rpc`` with control messages only.

Each worker runs the rollout's own `fleetrl.common.weightsync.receiver.receiver.WeightReceiver`, unchanged: the same
round protocol (join through the learner's TCPStore, form or reuse the group, receive every bucket
into flat buffers on the worker's device, NCCL on GPU, gloo on CPU) in a background thread while
generation goes on, and the same filesystem path. Only the destination differs: `WorkerLoader`
is the "engine" the receiver applies a complete version to, and it loads into vLLM's model through
``model_runner.reload_weights`` (the model's own ``load_weights`` name mapping onto fused layers,
then vLLM's post-processing). That call is the one vLLM's CPU backend needs, because it repacks
linear weights for its kernels (a plain ``model.load_weights`` fails there on size-0 parameters);
on GPU the same call reloads in place, so CUDA graphs keep their addresses.

Tensor parallel: every TP worker joins each round as a receiver of its own
(``<client id>/tp<rank>``), receives the whole model and keeps its own shard (``load_weights``
slices by TP rank). The server applies a version only when every worker holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

log = logging.getLogger("fleetrl.rollout.vllm_worker")


class WorkerLoader:
    """The receiver's "engine" inside a worker: checks names, shapes and dtypes, then reloads the model."""

    def __init__(self, worker: Any, specs: list[tuple[str, tuple[int, ...], str]], aliases: dict[str, str]):
        self.worker = worker
        self.specs, self.aliases = specs, aliases  # aliases: lm_head.weight -> model.embed_tokens.weight (tied)
        self.shapes = {name: tuple(shape) for name, shape, _ in specs}
        self.shapes.update({alias: self.shapes[name] for alias, name in aliases.items()})
        self.floats = {name for name, _, dtype in specs if dtype.startswith(("float", "bfloat"))}
        self.floats |= {alias for alias, name in aliases.items() if name in self.floats}

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        from fleetrl.rollout.engines.weight_files import check_named_tensors

        named = list(named_tensors)
        check_named_tensors(named, self.shapes, self.floats, "update_weights")
        self._reload(named)

    def load_weights_from_dir(self, path: str) -> None:
        from safetensors import safe_open

        from fleetrl.rollout.engines.weight_files import (
            check_named_shapes,
            missing_weights,
            safetensors_files,
            safetensors_shapes,
        )

        files = safetensors_files(path)
        shapes = safetensors_shapes(files)
        check_named_shapes(shapes, self.shapes, f"load_weights_from_dir({path!r})")
        self._check_file_dtypes(files, path)
        missing = missing_weights([(n, s, d) for n, s, d in self.specs], [name for name, _ in shapes], self.aliases)
        if missing:
            raise ValueError(
                f"load_weights_from_dir({path!r}): {len(missing)} weights are missing, e.g. {missing[:3]}. "
                "No weight was changed."
            )
        named = []
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                named += [(name, f.get_tensor(name)) for name in f.keys()]
        self._reload(named)

    def _check_file_dtypes(self, files: list[Any], path: str) -> None:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    dtype = f.get_slice(name).get_dtype()
                    if name in self.floats and not dtype.startswith(("F", "BF")):
                        raise ValueError(
                            f"load_weights_from_dir({path!r}): weight {name!r} is stored as {dtype} but "
                            "the model's is floating point. No weight was changed."
                        )

    def _reload(self, named: list[tuple[str, Any]]) -> None:
        """Into the model, with every tied alias present: vLLM keeps the old head when it is missing."""
        self.worker.model_runner.reload_weights(
            weights_iterator=with_aliases(named, self.aliases), is_checkpoint_format=True
        )


def with_aliases(named: list[tuple[str, Any]], aliases: dict[str, str]) -> Iterator[tuple[str, Any]]:
    """``named``, plus each tied alias (``lm_head.weight``) that is missing, as its target's tensor."""
    by_name = dict(named)
    yield from named
    for alias, target in aliases.items():
        if alias not in by_name and target in by_name:
            yield alias, by_name[target]


class FleetrlWorkerExtension:
    """Methods vLLM adds to its worker; ``self`` is the worker (``self.model_runner``, ``self.device``)."""

    def fleetrl_init(
        self, cfg_json: bytes, client_id: str, specs: list[tuple[str, tuple[int, ...], str]], aliases: dict[str, str]
    ) -> None:
        import msgspec

        from fleetrl.common.config.schema import JobConfig
        from fleetrl.common.weightsync.receiver.receiver import WeightReceiver

        cfg = msgspec.json.decode(cfg_json, type=JobConfig)
        self.fleetrl_close()  # a receiver built earlier (a second engine.weight_receiver call) stops
        rank = int(getattr(self, "rank", 0) or 0)
        self._fleetrl_loader = WorkerLoader(self, specs, aliases)
        self._fleetrl_receiver = WeightReceiver(cfg, specs, str(self.device), f"{client_id}/tp{rank}")

    def fleetrl_on_version(self, version: int, info: bytes) -> None:
        import msgspec

        from fleetrl.common import messages

        self._fleetrl_receiver.on_version(version, msgspec.msgpack.decode(info, type=messages.WeightsInfo))

    def fleetrl_poll(self) -> tuple[int | None, dict[str, float]]:
        return self._fleetrl_receiver.pending_version(), self._fleetrl_receiver.stats()

    def fleetrl_apply(self, version: int) -> int | None:
        """Load ``version`` if it is the one pending (generation is paused meanwhile)."""
        if self._fleetrl_receiver.pending_version() != version:
            return None
        return self._fleetrl_receiver.apply(self._fleetrl_loader)

    def fleetrl_close(self) -> None:
        receiver = getattr(self, "_fleetrl_receiver", None)
        if receiver is not None:
            receiver.close()
