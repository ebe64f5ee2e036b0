"""Token-in/token-out through the endpoint with prompts that differ inside one group (issue 28, "groups
never rebase silently"): chat sessions opened with and without a system message and a completions session
form one group, through the real server, the real endpoint, the broker twin and the learner's packing.

What is trained is the context each call sent: every sample keeps its own prompt on the wire, each call's
context (recorded at the engine) is that prompt plus the sample's tokens so far, the replies the agent got
are the mask-1 tokens decoded with their special tokens, and the behaviour log-probs equal a teacher-forced
forward of the learner's own log-prob function to <= 1e-5. Before the fix a sample opened without the
system message was trained under ``<|system|>`` (log-probs off by ~0.2), then later dropped."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.learner.batch import pack_groups
from fleetrl.learner.update import response_logprobs
from fleetrl.rollout.endpoint.server import Endpoint
from tests.rollout.endpoint.test_endpoint import SESSIONS
from tests.rollout.test_server import Fleet, wait_for

G = 4


class Recording:
    """The engine, with every request's context and generation recorded in order."""

    def __init__(self, engine):
        self.inner, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        out = await self.inner.generate(request)
        self.calls.append((list(request.prompt_ids), out))
        return out


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def chat_agent(base_url, prompt, system):
    c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    messages = ([{"role": "system", "content": "Answer briefly."}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    replies = []
    for follow in ("Are you sure?", None):
        r = c.chat.completions.create(model="m", messages=messages, max_tokens=5)
        replies.append(r.choices[0].message.content)
        if follow:
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": follow},
            ]
    return replies


def text_agent(base_url, prompt):
    c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
    text, replies = f"Q: {prompt}\nA:", []
    for follow in ("\nQ: sure?\nA:", None):
        r = c.completions.create(model="m", prompt=text, max_tokens=5)
        replies.append(r.choices[0].text)
        text += r.choices[0].text + (follow or "")
    return replies


def test_a_group_of_differing_prompts_trains_each_call_s_own_context(engine, tiny_model_dir, reference):
    rec = Recording(engine)
    fleet = Fleet(
        rec, tiny_model_dir, *SESSIONS, f"rollout.group_size={G}", f"rollout.env.min_group_samples={G}", n_prompts=8
    )
    fleet.server.endpoint = Endpoint(fleet.cfg, rec, fleet.server.env)
    tok = engine.tokenizer
    kinds = ["system", "plain", "text", "plain"]
    replies = {}
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        root = fleet.server.endpoint.root
        opened = [httpx.post(f"{root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json() for _ in range(G)]
        assert len({s["group"] for s in opened}) == 1  # one task's sessions: one group
        for k, (s, kind) in enumerate(zip(opened, kinds)):
            prompt = s["task"]["prompt"]
            got = (
                text_agent(s["base_url"], prompt)
                if kind == "text"
                else chat_agent(s["base_url"], prompt, kind == "system")
            )
            replies[float(k)] = (kind, got)
            closed = httpx.post(f"{root}/fleetrl/sessions/{s['session_id']}/close", json={"reward": float(k)}).json()
            assert closed["turns"] == 2
        groups = []
        wait_for(lambda: groups.extend(fleet.drain()) or groups, 30, "the group")
    finally:
        fleet.stop()
    [g] = groups
    assert g.num_responses == G and len(g.prompt_lengths) == G  # every sample kept, each with its own prompt
    assert fleet.server.env.stats.totals["groups_per_sample_prompts"] == 1
    offsets, mask_all = g.offsets(), g.loss_mask_array()
    for i in range(G):
        kind, got = replies[g.rewards[i]]
        prompt, tokens = g.prompt_of(i).tolist(), g.token_array()[offsets[i] : offsets[i + 1]].tolist()
        mask = mask_all[offsets[i] : offsets[i + 1]]
        head = tok.decode(prompt)
        assert head.startswith({"system": "<|system|>Answer briefly.", "plain": "<|user|>", "text": "Q: "}[kind])
        # each call's context, as the engine got it, is this sample's prompt + its tokens so far
        whole = prompt + tokens
        calls = [
            (ctx, out)
            for ctx, out in rec.calls
            if ctx[: len(prompt)] == prompt
            and whole[: len(ctx)] == ctx
            and whole[len(ctx) : len(ctx) + len(out.token_ids)] == out.token_ids
        ]
        assert len(calls) == 2  # both calls of this session, and no other session's
        for ctx, out in calls:
            pos, n = len(ctx) - len(prompt), len(out.token_ids)
            assert mask[pos : pos + n].all()  # the sampled tokens are trained (mask 1) ...
            assert pos == 0 or mask[pos - 1] == 0  # ... and the second call's follows its observation (mask 0)
        # the replies the agent got are the sampled tokens, special tokens included (a final stop token is not shown)
        cuts = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        segments = [tokens[a:b] for a, b in zip(cuts[::2], cuts[1::2])]
        shown = [tok.decode(s[:-1] if s[-1] == tok.eos_token_id else s, skip_special_tokens=False) for s in segments]
        assert shown == got, (kind, shown, got)
    # the learner packs each sample after its own prompt; its log-probs match the engine's to 1e-5
    batch = pack_groups(groups, 4096, torch.device("cpu"))
    worst = 0.0
    for mb in batch.micro:
        for row, i in enumerate(mb.index.tolist()):
            p, n = g.prompt_lengths[i], g.lengths[i]
            assert mb.input_ids[row, : p + n].tolist() == g.prompt_of(i).tolist() + g.response_tokens(i).tolist()
        with torch.no_grad():
            logp, _ = response_logprobs(reference, mb, 1.0)
        worst = max(worst, float((logp - mb.behav_logp).abs()[mb.mask > 0].max()))
    assert worst <= 1e-5, worst
