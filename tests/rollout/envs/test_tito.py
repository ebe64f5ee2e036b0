"""Token-in/token-out is exact: multi-turn episodes (>= 8 turns) through the real server, the broker
twin and the learner's packing. What the learner trains equals what the engine sampled, byte for byte;
every request's context is the token list itself (never re-tokenized); observations are the template's
text as tokens with mask 0; and the behaviour log-probs equal a teacher-forced forward of the learner's
own log-prob function to <= 1e-5 on the masked-in tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.learner.batch import pack_groups
from fleetrl.learner.update import response_logprobs
from tests.rollout.test_server import Fleet, wait_for

TURNS = 9
ENV = [
    "rollout.env.type=user",
    "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:Chatter",
    f"rollout.env.user.args={{turns: {TURNS}}}",
    "rollout.env.max_turns=12",
    "rollout.env.max_tokens_per_turn=5",
    "rollout.env.max_total_tokens=400",
]


class Recording:
    """The engine, with every request and its generation recorded (by request id)."""

    def __init__(self, engine):
        self.inner, self.calls = engine, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        out = await self.inner.generate(request)
        self.calls[request.request_id] = (list(request.prompt_ids), out)
        return out


def episodes_of(calls):
    """request-id prefix (one episode) -> its turns in order: [(context, generation)]."""
    out = {}
    for rid, call in calls.items():
        episode, _, turn = rid.rpartition("/turn-")
        out.setdefault(episode, {})[int(turn)] = call
    return {k: [v[t] for t in sorted(v)] for k, v in out.items()}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_multi_turn_tokens_trained_are_the_tokens_sampled(engine, tiny_model_dir, reference):
    rec = Recording(engine)
    fleet = Fleet(rec, tiny_model_dir, *ENV, "rollout.group_size=2", "rollout.prompts_per_batch=2", n_prompts=4)
    tok = engine.tokenizer
    try:
        fleet.start_thread()
        groups = []
        wait_for(lambda: groups.extend(fleet.drain()) or len(groups) >= 3, 120, "multi-turn groups")
    finally:
        fleet.stop()
    by_episode = episodes_of(rec.calls)
    checked = 0
    for g in groups:
        prompt = g.prompt_array().tolist()
        mask_all, tokens_all, logp_all = g.loss_mask_array(), g.token_array(), g.logprob_array()
        assert g.metadata["turns"] == [TURNS] * g.num_responses  # >= 8 turns each
        assert tok.decode(prompt) == f"<|user|>chat about {fleet.prompt_text(g.prompt_id)}<eos><|assistant|>"
        offsets = g.offsets()
        for i in range(g.num_responses):
            a, b = offsets[i], offsets[i + 1]
            tokens, mask, logp = tokens_all[a:b], mask_all[a:b], logp_all[a:b]
            # find the episode whose first request had this prompt and whose samples are these tokens
            turns = next(
                t
                for t in by_episode.values()
                if t[0][0] == prompt
                and np.array_equal(np.concatenate([np.asarray(o.token_ids, np.int32) for _, o in t]), tokens[mask == 1])
            )
            assert len(turns) == TURNS
            sampled = np.concatenate([np.asarray(o.token_ids, np.int32) for _, o in turns])
            assert tokens[mask == 1].tobytes() == sampled.tobytes()  # byte for byte
            assert (
                logp[mask == 1].tobytes()
                == np.concatenate([np.asarray(o.logprobs, np.float32) for _, o in turns]).tobytes()
            )
            # every request's context was prompt + the response tokens so far: never re-tokenized
            pos = 0
            for t, (context, out) in enumerate(turns):
                assert context == prompt + tokens[:pos].tolist(), f"turn {t} context"
                assert tokens[pos : pos + len(out.token_ids)].tolist() == out.token_ids
                assert mask[pos : pos + len(out.token_ids)].tolist() == [1] * len(out.token_ids)
                pos += len(out.token_ids)
                obs_end = pos + int(np.argmax(mask[pos:] == 1)) if t + 1 < len(turns) else len(tokens)
                obs = tok.decode(tokens[pos:obs_end].tolist())
                n = t + 1
                if t + 1 < len(turns):  # the observation: the template's text, as tokens, mask 0
                    tail = "" if out.token_ids[-1] == tok.eos_token_id else "<eos>"
                    text = f"go on {n}" if n % 2 else f"tool says {n}"
                    role = "user" if n % 2 else "tool"
                    assert obs == f"{tail}<|{role}|>{text}<eos><|assistant|>", (t, obs)
                    assert (mask[pos:obs_end] == 0).all()
                pos = obs_end
            checked += 1
    assert checked >= 6
    # the learner's packing and its own log-prob function (teacher forcing over the whole episode)
    batch = pack_groups(groups, 4096, torch.device("cpu"))
    worst = 0.0
    for mb in batch.micro:
        with torch.no_grad():
            logp, _ = response_logprobs(reference, mb, 1.0)
        on = mb.mask > 0
        for row, idx in enumerate(mb.index.tolist()):
            g_i, r_i = divmod(idx, 2)
            g = groups[g_i]
            a, b = g.offsets()[r_i], g.offsets()[r_i + 1]
            n = b - a
            assert mb.targets[row, :n].numpy().astype(np.int32).tobytes() == g.token_array()[a:b].tobytes()
            assert mb.mask[row, :n].numpy().tolist() == g.loss_mask_array()[a:b].astype(np.float32).tolist()
        worst = max(worst, float((logp - mb.behav_logp).abs()[on].max()))
    assert worst <= 1e-5, worst
    assert batch.last.tolist() == [
        int(np.flatnonzero(g.loss_mask_array()[g.offsets()[i] : g.offsets()[i + 1]])[-1])
        for g in groups
        for i in range(g.num_responses)
    ]
