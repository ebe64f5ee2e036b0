"""The streaming loop's pieces on the `hf` engine: in-flight updates (keep / recompute / finish) with
per-token versions, per-request seeds inside a wave, the in-flight budget, and per-token versions on
the wire with the oldest as the group's policy_version."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.common import messages as m
from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.rollout.engines import Generation, Request, SamplingParams, create_engine
from fleetrl.rollout.loop import Batch, build_groups, group_versions
from fleetrl.rollout.rewards import RewardResult
from tests.rollout.test_server import Fleet, wait_for


@pytest.fixture(scope="module")
def flipped(tiny_model_dir):
    """The tiny model with its final norm negated: every logit flips sign, so greedy picks other tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.neg_()
    return model


def teacher_forced(model, prompt, response):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.mark.parametrize("mode", ["keep", "recompute", "finish"])
def test_hf_inflight_update_records_the_version_of_every_token(tiny_model_dir, flipped, mode):
    engine = create_engine("hf", ModelConfig(path=tiny_model_dir), RolloutConfig(), "cpu", 0, num_threads=1)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    prompt = engine.tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    try:
        long = engine.submit(Request(prompt, SamplingParams(temperature=0, max_new_tokens=400)))
        wait_for(lambda: engine._thread is not None and not engine._pending, what="the wave to start")
        time.sleep(0.05)  # a few of its 400 steps

        def load():
            engine.update_weights(flipped.state_dict().items())
            return 1

        assert engine.loop.call(engine.swap_weights(load, mode)) == 1 and engine.version == 1
        out = long.result(60)
        n = len(out.token_ids)
        if mode == "finish":  # it ran to its end on the old weights before the update
            assert out.versions == [0] * n
            return
        k = out.versions.index(1)
        assert 0 < k < n and out.versions == [0] * k + [1] * (n - k)
        old = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert torch.allclose(teacher_forced(old, prompt, out.token_ids[:k]), torch.tensor(out.logprobs[:k]), atol=1e-4)
        if mode == "recompute":  # prompt + tokens so far prefilled again with the new weights: exact
            new = teacher_forced(flipped, prompt, out.token_ids)[k:]
            assert torch.allclose(new, torch.tensor(out.logprobs[k:]), atol=1e-4)
    finally:
        engine.update_weights(original.items())
        engine.close()


def test_per_request_seeds_do_not_depend_on_the_rest_of_the_wave(engine):
    prompt = engine.tokenizer("7+8=", add_special_tokens=False)["input_ids"]
    other = engine.tokenizer("99+99=", add_special_tokens=False)["input_ids"]
    seeded = Request(prompt, SamplingParams(max_new_tokens=10, seed=42))
    alone = engine.loop.call(engine.generate_many([seeded]))[0]
    crowd = engine.loop.call(
        engine.generate_many(
            [Request(other, SamplingParams(max_new_tokens=10)) for _ in range(5)] + [Request(prompt, seeded.params)]
        )
    )[-1]
    assert alone.token_ids == crowd.token_ids


def test_group_versions_take_the_oldest_and_send_per_token_versions_only_when_they_differ():
    same = [Generation([1, 2], [-1.0, -1.0], "stop", "", versions=[3, 3])]
    assert group_versions(same, 3) == (3, None)
    spans = same + [Generation([4, 5, 6], [-1.0] * 3, "length", "", versions=[2, 2, 3])]
    assert group_versions(spans, 3) == (2, [[3, 3], [2, 2, 3]])
    assert group_versions([Generation([], [], "stop", "")], 4) == (4, None)

    lease = m.PromptLease(req_id=1, lease_id="L", expires_in_s=60.0, prompts=[m.Prompt(prompt_id="0:0", prompt="x")])
    batch = Batch(lease, [[1, 2, 3]], [spans], 3, 0.1, Future())
    [group], _, _ = build_groups(batch, [RewardResult(1.0, {}, False)] * 2, "r", lambda res: False)
    assert group.policy_version == 2 and group.version_array().tolist() == [3, 3, 2, 2, 3]
    assert m.check_group(group) is None
    decoded = m.decode_request(m.encode(m.PushGroups(req_id=1, client_id="r", groups=[group])))
    assert decoded.groups[0].version_array().tolist() == [3, 3, 2, 2, 3]  # zero-copy on the wire


def test_prompts_in_flight_never_exceed_max_inflight(engine, tiny_model_dir):
    fleet = Fleet(
        engine, tiny_model_dir, "rollout.max_inflight=3", "rollout.prompts_per_batch=2", "broker.queue_capacity=1000"
    ).start_thread()
    try:
        seen = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            seen.append(fleet.server.heartbeat_stats()[1]["rollout/inflight"])
            time.sleep(0.005)
        assert max(seen) <= 3 and max(seen) >= 2
        wait_for(lambda: fleet.state.counters["groups_in"] >= 6, what="groups")
        assert fleet.state.prompts.leased <= 3
    finally:
        assert fleet.stop() == 0
