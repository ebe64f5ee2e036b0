"""``learner.shared_prompts``: each distinct prompt of a micro-batch is forwarded once and its samples'
responses attend to its keys and values. The log-probs, entropies and gradients must be those of one
forward over every ``prompt + response`` row (issue 24: the learner's FLOPs, not its numbers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.common import messages as m
from fleetrl.learner.batch import pack_groups
from fleetrl.learner.update import response_logprobs


def groups_of(prompts: list[list[int]], sizes: list[int], max_len: int = 6, seed: int = 0) -> list[m.SampleGroup]:
    """One group per prompt (prompts of different lengths), responses of ragged lengths in 1..max_len."""
    rng = np.random.default_rng(seed)
    out = []
    for g, (prompt, k) in enumerate(zip(prompts, sizes)):
        responses = []
        for _ in range(k):
            t = int(rng.integers(1, max_len + 1))
            responses.append((rng.integers(7, 263, t), np.full(t, -1.0)))
        out.append(m.build_group(f"g{g}", f"0:{g}", 0, prompt, responses, [float(i % 2) for i in range(k)]))
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).float()


def both(groups, max_tokens: int = 4096):
    full = pack_groups(groups, max_tokens, torch.device("cpu"))
    shared = pack_groups(groups, max_tokens, torch.device("cpu"), share_prompts=True)
    return full, shared


def grads(model, logp, mask) -> list[torch.Tensor]:
    model.zero_grad()
    (logp * mask).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_logprobs_entropy_and_gradients_equal_the_full_forward(model, temperature):
    full, shared = both(groups_of(PROMPTS, [4, 3, 5, 2]))
    [a], [b] = full.micro, shared.micro
    assert a.shared is None and b.shared is not None
    assert b.shared.prompt_ids.shape[0] == len(PROMPTS)  # each prompt once, padded to the longest
    assert sorted(b.shared.prompt_len.tolist()) == sorted(len(p) for p in PROMPTS)
    la, ea = response_logprobs(model, a, temperature, entropy=True)
    lb, eb = response_logprobs(model, b, temperature, entropy=True)
    mask = a.mask
    assert torch.equal(a.mask, b.mask) and torch.equal(a.targets, b.targets)
    assert ((la - lb).abs() * mask).max() < 1e-5
    assert ((ea - eb).abs() * mask).max() < 1e-5
    ga, gb = grads(model, la, mask), grads(model, lb, mask)
    for x, y in zip(ga, gb):
        assert (x - y).norm() <= 1e-4 * x.norm() + 1e-7


def test_a_row_reads_its_own_prompt_not_another():
    """Every row's prompt index names the prompt it was packed after in the full layout."""
    full, shared = both(groups_of(PROMPTS, [4, 3, 5, 2]))
    [a], [b] = full.micro, shared.micro
    sp = b.shared
    for row in range(a.size):
        p = int(sp.prompt_len[sp.row_prompt[row]])
        assert sp.prompt_ids[sp.row_prompt[row], :p].tolist() == a.input_ids[row, :p].tolist()
        n = min(int(a.mask[row].sum()), sp.response_ids.shape[1])  # the inputs: all but the last token
        assert sp.response_ids[row, :n].tolist() == a.targets[row, :n].tolist()
        assert sp.response_mask[row].sum() == n


def test_wrong_prompts_would_show(model):
    """The check above is not vacuous: rows pointed at another prompt give other log-probs."""
    full, shared = both(groups_of(PROMPTS, [4, 3, 5, 2]))
    [a], [b] = full.micro, shared.micro
    b.shared.row_prompt = (b.shared.row_prompt + 1) % b.shared.prompt_ids.shape[0]
    la, _ = response_logprobs(model, a, 1.0)
    lb, _ = response_logprobs(model, b, 1.0)
    assert ((la - lb).abs() * a.mask).max() > 1e-2


def test_one_token_responses_need_only_the_prompt_pass(model):
    full, shared = both(groups_of(PROMPTS[:2], [3, 3], max_len=1))
    [a], [b] = full.micro, shared.micro
    assert b.shared is not None and b.shared.response_ids.shape[1] == 0
    la, _ = response_logprobs(model, a, 1.0)
    lb, _ = response_logprobs(model, b, 1.0)
    assert lb.shape == la.shape and ((la - lb).abs() * a.mask).max() < 1e-5


def test_distinct_prompts_keep_the_one_forward_layout():
    """No two rows share a prompt (one sample a group): nothing to share, the micro-batch is unchanged."""
    full, shared = both(groups_of(PROMPTS, [1, 1, 1, 1]))
    [a], [b] = full.micro, shared.micro
    assert b.shared is None
    for name in ("index", "input_ids", "attention_mask", "logit_pos", "targets", "mask", "behav_logp"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_several_micro_batches_each_share_their_own_rows(model):
    """With a small token budget the rows are split; each micro-batch carries only the prompts of its rows."""
    groups = groups_of(PROMPTS, [4, 3, 5, 2])
    full, shared = both(groups, max_tokens=40)
    assert len(shared.micro) > 1
    for a, b in zip(full.micro, shared.micro):
        assert torch.equal(a.index, b.index)
        la, _ = response_logprobs(model, a, 1.0)
        lb, _ = response_logprobs(model, b, 1.0)
        assert ((la - lb).abs() * a.mask).max() < 1e-5
        if b.shared is not None:
            assert int(b.shared.row_prompt.max()) < b.shared.prompt_ids.shape[0] <= b.size
