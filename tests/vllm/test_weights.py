"""Weights received inside the vLLM workers: a learner-side `WeightPublisher` here broadcasts over gloo
straight into the worker's own `WeightReceiver`; in-flight updates keep or recompute the requests in
flight and every token records its version; bad updates change nothing; a failed round is skipped."""

from __future__ import annotations

import time

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig, ModelConfig, RolloutConfig, SyncConfig
from fleetrl.common.messages import WeightsInfo
from fleetrl.common.weightsync.sender.publisher import WeightPublisher
from fleetrl.rollout.engines import Request, SamplingParams, create_engine
from tests.common.weightsync.test_store_attacks import forged_rounds_are_refused
from tests.conftest import free_port
from tests.vllm.conftest import ATOL, DEVICE, hf_model, teacher_forced_logp

PROMPTS = ["12+34=", "7+8=", "hello"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


def wait_for(cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def prompts_of(engine) -> list[list[int]]:
    return [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def greedy(engine) -> list[list[int]]:
    return [g[0].token_ids for g in engine.generate_batch(prompts_of(engine), GREEDY, 1)]


def hf_greedy(model_dir: str, prompts) -> list[list[int]]:
    hf = create_engine("hf", ModelConfig(path=model_dir, dtype="float32"), RolloutConfig(), "cpu", 0, num_threads=1)
    try:
        return [g[0].token_ids for g in hf.generate_batch(prompts, GREEDY, 1)]
    finally:
        hf.close()


def update(engine, receivers, mode: str = "keep") -> int | None:
    return engine.loop.call(engine.swap_weights(lambda: receivers.apply(engine), mode))


def fs_info(path: str) -> WeightsInfo:
    return WeightsInfo(transport="filesystem", path=str(path), published_at=time.time())


def test_gloo_broadcast_lands_in_the_worker_with_no_tensor_through_collective_rpc(vllm_engine, small_new_dir, tmp_path):
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=6, bucket_mb=1))
    receivers = vllm_engine.weight_receiver(cfg, DEVICE, "rollout-test")
    learner = AutoModelForCausalLM.from_pretrained(small_new_dir, dtype=torch.float32)
    specs = [ws.make_spec(n, p.shape, p.dtype) for n, p in learner.named_parameters()]
    pub = WeightPublisher(cfg, tmp_path, 0, specs)
    before = greedy(vllm_engine)
    try:
        # a round whose learner is gone: the worker skips it, counts it, and goes on generating
        dead = WeightsInfo(
            transport="gloo",
            master_addr="127.0.0.1",
            master_port=free_port(),
            round_id=1,
            buckets=pub.plan,
            published_at=time.time(),
            signer=pub._sender._signer.public,
        )
        receivers.on_version(1, dead)
        wait_for(
            lambda: receivers.pending_version(0) is None and receivers.stats().get("weights/rounds_missed", 0) >= 1,
            what="the failed round to be counted",
        )
        assert greedy(vllm_engine) == before

        # the next announcement catches it up: buckets broadcast by the learner, received in the worker
        rpc_before = vllm_engine.rpc_bytes
        metrics = pub.publish(2, 2, learner.named_parameters(), lambda info: receivers.on_version(2, info), 1)
        assert metrics["sync/receivers"] == 1 and metrics["sync/failed"] == 0
        wait_for(lambda: receivers.pending_version(0) == 2, what="version 2 received")
        assert update(vllm_engine, receivers, "keep") == 2 and vllm_engine.version == 2
        rpc_bytes = vllm_engine.rpc_bytes - rpc_before
        model_bytes = sum(p.numel() * p.element_size() for p in learner.parameters())
        assert rpc_bytes < 64 * 1024 and rpc_bytes < model_bytes / 50  # control messages only (plan, versions)
        (tmp_path / "rpc_bytes.txt").write_text(f"{rpc_bytes} bytes through collective_rpc, model {model_bytes}\n")

        # greedy output equals HF with the same weights; log-probs equal its teacher-forced forward
        assert greedy(vllm_engine) == hf_greedy(small_new_dir, prompts_of(vllm_engine)) != before
        ref = hf_model(small_new_dir)
        for prompt, [sample] in zip(
            prompts_of(vllm_engine),
            vllm_engine.generate_batch(prompts_of(vllm_engine), SamplingParams(max_new_tokens=16, seed=1), 1),
        ):
            assert sample.versions == [2] * len(sample.token_ids)
            assert (
                teacher_forced_logp(ref, prompt, sample.token_ids) - torch.tensor(sample.logprobs)
            ).abs().max() <= ATOL
    finally:
        receivers.close()
        pub.close()


def test_the_worker_takes_only_rounds_the_learner_signed(vllm_engine, small_new_dir):
    """Issue 31 in the worker: the announcement's signing key reaches the worker through collective_rpc
    (from the rollout server, which got it from the authenticated broker); an unsigned announcement, and a
    round plan written by anyone but that key's holder, are refused there, and the weights stay."""
    cfg = JobConfig(sync=SyncConfig(transport="gloo", timeout_s=5, bucket_mb=1))
    receivers = vllm_engine.weight_receiver(cfg, DEVICE, "rollout-test")
    model = AutoModelForCausalLM.from_pretrained(small_new_dir, dtype=torch.float32)
    plan = ws.plan_buckets([ws.make_spec(n, p.shape, p.dtype) for n, p in model.named_parameters()], ws.MB)
    try:
        forged_rounds_are_refused(receivers, plan, lambda: greedy(vllm_engine))
    finally:
        receivers.close()


def test_a_version_switch_mid_request_is_recorded_per_token(vllm_engine, small_dir, small_new_dir):
    """keep: the request goes on over its KV cache; recompute: its KV is recomputed with the new weights,
    so every later log-prob is the new model's teacher-forced one."""
    receivers = vllm_engine.weight_receiver(JobConfig(sync=SyncConfig(transport="filesystem")), DEVICE, "rollout-test")
    [prompt] = [vllm_engine.tokenizer("12+34=", add_special_tokens=False)["input_ids"]]
    try:
        for mode, old_dir, new_dir, version in [
            ("keep", None, small_dir, 10),
            ("recompute", small_dir, small_new_dir, 11),
        ]:
            old = vllm_engine.version
            receivers.on_version(version, fs_info(new_dir))
            wait_for(lambda: receivers.pending_version(0) == version, what=f"version {version} pending")
            long = vllm_engine.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=480)))
            vllm_engine.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=3))).result(60)
            assert update(vllm_engine, receivers, mode) == version and not long.done()
            out = long.result(120)
            k = out.versions.index(version)
            assert 0 < k <= len(out.token_ids) and out.versions == [old] * k + [version] * (len(out.token_ids) - k)
            if old_dir is not None:  # the tokens before the switch: the old weights' own log-probs
                lp = teacher_forced_logp(hf_model(old_dir), prompt, out.token_ids[:k])
                assert (lp - torch.tensor(out.logprobs[:k])).abs().max() <= ATOL
            if mode == "recompute" and k < len(out.token_ids):
                lp = teacher_forced_logp(hf_model(new_dir), prompt, out.token_ids)[k:]
                assert (lp - torch.tensor(out.logprobs[k:])).abs().max() <= ATOL
    finally:
        receivers.close()


def test_wrong_names_shapes_or_dtypes_are_refused_before_any_weight_changes(vllm_engine, small_dir, tmp_path):
    receivers = vllm_engine.weight_receiver(JobConfig(sync=SyncConfig(transport="filesystem")), DEVICE, "rollout-test")
    state = AutoModelForCausalLM.from_pretrained(small_dir).state_dict()
    state.pop("lm_head.weight")
    before = greedy(vllm_engine)
    try:
        bad = {
            "shape": {**state, "model.norm.weight": torch.zeros(7)},
            "name": {**state, "model.nope.weight": torch.zeros(3)},
            "dtype": {**state, "model.norm.weight": torch.zeros(state["model.norm.weight"].shape, dtype=torch.int32)},
        }
        for i, (what, tensors) in enumerate(bad.items()):
            path = tmp_path / what
            path.mkdir()
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
            version = 100 + i
            receivers.on_version(version, fs_info(path))
            wait_for(lambda: receivers.pending_version(0) == version, what="the bad version pending")
            assert update(vllm_engine, receivers) is None
            assert receivers.stats()["weights/load_failed"] == i + 1
            assert greedy(vllm_engine) == before, what
    finally:
        receivers.close()
