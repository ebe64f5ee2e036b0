"""The learner packs every sample after the prompt it was sampled from (issue 28): a group with per-sample
prompts (``SampleGroup.prompt_lengths``) trains each context as it was, and online DPO pairs keep each side's
own prompt. A group whose samples share one prompt packs exactly as before."""

from __future__ import annotations

import torch

from fleetrl.common import messages as m
from fleetrl.learner.batch import pack_groups
from fleetrl.learner.dpo import online_pairs
from fleetrl.learner.source import Leased

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
RESPONSES = [([10, 11, 12], [-0.1, -0.2, -0.3]), ([13], [-0.4]), ([14, 15], [-0.5, -0.6])]


def per_sample_group(prompts=PROMPTS):
    return m.decode_group(
        m.encode(m.build_group("g", "p", 0, prompts, RESPONSES, [1.0, 0.0, 0.5], per_sample_prompts=True))
    )


def test_each_sample_is_packed_after_its_own_prompt():
    g = per_sample_group()
    batch = pack_groups([g], 4096, torch.device("cpu"))
    [mb] = batch.micro
    for row, i in enumerate(mb.index.tolist()):
        prompt, (resp, logp) = PROMPTS[i], RESPONSES[i]
        n, p = len(resp), len(prompt)
        assert mb.input_ids[row, : p + n].tolist() == prompt + resp and mb.attention_mask[row].sum() == p + n
        assert mb.targets[row, :n].tolist() == resp
        assert mb.logit_pos[row, :n].tolist() == list(range(p - 1, p - 1 + n))  # logits at p-1+t predict token t
        assert torch.allclose(mb.behav_logp[row, :n], torch.tensor(logp))


def test_per_sample_prompts_that_are_all_the_same_pack_like_a_shared_prompt():
    shared = m.build_group("g", "p", 0, PROMPTS[0], RESPONSES, [1.0, 0.0, 0.5])
    a = pack_groups([shared], 4096, torch.device("cpu"))
    b = pack_groups([per_sample_group([PROMPTS[0]] * 3)], 4096, torch.device("cpu"))
    for x, y in zip(a.micro, b.micro):
        for name in ("index", "input_ids", "attention_mask", "logit_pos", "targets", "mask", "behav_logp"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name


def test_online_dpo_pairs_keep_each_side_s_prompt():
    batch = online_pairs(Leased(groups=[per_sample_group()]), 4096, torch.device("cpu"))
    [chunk] = batch.chunks
    rows = chunk.rows.tolist()  # chosen (reward 1.0: sample 0) then rejected (reward 0.0: sample 1)
    chosen, rejected = chunk.mb.input_ids[rows[0]].tolist(), chunk.mb.input_ids[rows[1]].tolist()
    assert chosen[:7] == PROMPTS[0] + RESPONSES[0][0] and rejected[:3] == PROMPTS[1] + RESPONSES[1][0]
