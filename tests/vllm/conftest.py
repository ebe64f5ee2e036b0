"""The vLLM lane (`make test-vllm`, run by .ci/run): vLLM's async engine on its CPU backend in `.venv-vllm`
(scripts/vllm_env.sh), or on a GPU (scripts/gpu_check.sh sets FLEETRL_VLLM_DEVICE=cuda).

The lane's environment sets FLEETRL_VLLM_LANE=1: there a missing vLLM fails the lane. Anywhere else
(`make test-all` in `.venv`) these tests are skipped, since vLLM cannot share `.venv`'s torch.
Models are built locally in float32, with head_dim >= 32 (vLLM's CPU attention kernels take head
sizes 32, 64, 80, ...): the `tiny32` and `small` presets.
"""

from __future__ import annotations

import importlib.util
import os
import threading

import pytest
import torch

LANE = os.environ.get("FLEETRL_VLLM_LANE") == "1"
DEVICE = os.environ.get("FLEETRL_VLLM_DEVICE", "cpu")
ATOL = 1e-4  # behaviour log-probs against an HF teacher-forced forward, float32

if importlib.util.find_spec("vllm") is None:
    if LANE:
        raise RuntimeError(
            "FLEETRL_VLLM_LANE=1 but vLLM is not importable: build the lane's environment with "
            "`bash scripts/vllm_env.sh` and run `make test-vllm`"
        )
    collect_ignore_glob = ["test_*.py"]


def build(tmp_path_factory, preset: str, seed: int, name: str) -> str:
    from fleetrl.learner.init_model import init_model

    return str(init_model(tmp_path_factory.mktemp("vllm-models") / name, preset=preset, seed=seed))


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory) -> str:
    return build(tmp_path_factory, "small", 0, "small")


@pytest.fixture(scope="session")
def small_new_dir(tmp_path_factory, small_dir) -> str:
    """The small model with other weights: final norm negated (every logit flips sign, so greedy picks
    other tokens) and every weight perturbed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(small_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
        model.model.norm.weight.neg_()
    out = str(tmp_path_factory.mktemp("vllm-models") / "small-new")
    model.save_pretrained(out)  # save_pretrained leaves lm_head.weight out (tied): the engine must add it
    AutoTokenizer.from_pretrained(small_dir).save_pretrained(out)
    return out


def rollout_cfg(**overrides):
    from fleetrl.common.config.schema import RolloutConfig, VllmConfig

    base = dict(temperature=1.0, vllm=VllmConfig(enforce_eager=True, max_model_len=512))
    base.update(overrides)
    return RolloutConfig(**base)


@pytest.fixture(scope="session")
def vllm_engine(small_dir):
    """One vLLM engine for the session (start-up is ~10-25 s on CPU)."""
    from fleetrl.common.config.schema import ModelConfig
    from fleetrl.rollout.engines import create_engine

    engine = create_engine("vllm", ModelConfig(path=small_dir, dtype="float32"), rollout_cfg(), DEVICE, 0)
    yield engine
    engine.close()


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def teacher_forced_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log_softmax(logits)[token] of each response token, one unpadded forward (T = 1)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def run_in_thread(fn, *args):
    """Start ``fn(*args)`` in a thread; returns (thread, box) where box["result"] / box["error"] is set."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box
