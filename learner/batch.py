"""From leased SampleGroups to training tensors, and from a batch to micro-batches.

Shape legend: B samples (responses) in the batch, T the longest response, L = prompt + response
length of a micro-batch's longest sequence.

A batch keeps every sample's prompt and response unpadded; micro-batches are formed by token budget
(``learner.max_tokens_per_microbatch``) over samples sorted by length, and each is right-padded only
to its own longest sequence — never the whole batch to the longest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fleetrl.common.messages import SampleGroup


@dataclass
class Batch:
    """One step's samples. Response tensors are ``[B, T]``, right-padded, ``mask`` marks real tokens."""

    prompts: list[np.ndarray]  # B arrays of prompt ids
    responses: torch.Tensor  # [B, T] int64 token ids (0 where masked)
    mask: torch.Tensor  # [B, T] float 1/0
    behav_logp: torch.Tensor  # [B, T] float32 behaviour log-probs from the engine
    rewards: torch.Tensor  # [B] float32 outcome rewards
    group_index: torch.Tensor  # [B] int64, same value = same prompt
    versions: torch.Tensor  # [B] int64 policy version that generated each sample
    lengths: torch.Tensor  # [B] int64 response lengths
    truncated: torch.Tensor  # [B] bool: finish_reason == "length"
    group_ids: list[str] = field(default_factory=list)  # one per group, in group_index order
    traces: list[dict[str, str]] = field(default_factory=list)  # W3C context per group

    @property
    def size(self) -> int:
        return self.responses.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def select(self, idx: torch.Tensor) -> "Batch":
        """The samples at ``idx`` (group bookkeeping kept as is)."""
        ids = idx.tolist()
        return Batch([self.prompts[i] for i in ids], self.responses[idx], self.mask[idx], self.behav_logp[idx],
                     self.rewards[idx], self.group_index[idx], self.versions[idx], self.lengths[idx],
                     self.truncated[idx], self.group_ids, self.traces)


def batch_from_groups(groups: list[SampleGroup]) -> Batch:
    """Flatten groups into one Batch; responses are right-padded to the longest (T >= 1)."""
    prompts, resp, logps, rewards, gidx, versions, lengths, truncated = [], [], [], [], [], [], [], []
    for gi, g in enumerate(groups):
        prompt = g.prompt_array().astype(np.int64)
        tokens, lps, offsets = g.token_array(), g.logprob_array(), g.offsets()
        for i in range(g.num_responses):
            prompts.append(prompt)
            resp.append(tokens[offsets[i] : offsets[i + 1]])
            logps.append(lps[offsets[i] : offsets[i + 1]])
            rewards.append(g.rewards[i])
            gidx.append(gi)
            versions.append(g.policy_version)
            lengths.append(int(g.lengths[i]))
            truncated.append(g.finish_reason(i) == "length")
    B, T = len(resp), max(1, max(lengths, default=1))
    responses = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.zeros(B, T)
    behav = torch.zeros(B, T)
    for b, (r, lp) in enumerate(zip(resp, logps)):
        n = len(r)
        responses[b, :n] = torch.from_numpy(r.astype(np.int64))
        mask[b, :n] = 1.0
        behav[b, :n] = torch.from_numpy(lp.astype(np.float32))
    return Batch(prompts, responses, mask, behav, torch.tensor(rewards, dtype=torch.float32),
                 torch.tensor(gidx, dtype=torch.int64), torch.tensor(versions, dtype=torch.int64),
                 torch.tensor(lengths, dtype=torch.int64), torch.tensor(truncated, dtype=torch.bool),
                 [g.group_id for g in groups], [g.trace for g in groups])


@dataclass
class MicroBatch:
    """Samples ``index`` of the batch as one right-padded forward pass."""

    index: torch.Tensor  # [b] positions in the batch
    input_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor  # [b, L]
    logit_pos: torch.Tensor  # [b, T] position whose logits predict response token t (clamped where masked)
    response_len: int  # T of this micro-batch


def micro_batches(batch: Batch, index: torch.Tensor, max_tokens: int, pad_id: int = 0) -> list[MicroBatch]:
    """Pack samples ``index`` into micro-batches of at most ``max_tokens`` padded tokens each.

    Samples are sorted by total length so each micro-batch pads little; a sample longer than the
    budget gets a micro-batch of its own.
    """
    ids = index.tolist()
    total = {i: len(batch.prompts[i]) + int(batch.lengths[i]) for i in ids}
    ids.sort(key=lambda i: total[i])
    groups: list[list[int]] = []
    for i in ids:
        if groups and (len(groups[-1]) + 1) * total[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [_pack(batch, g, pad_id) for g in groups]


def _pack(batch: Batch, ids: list[int], pad_id: int) -> MicroBatch:
    T = max(1, max(int(batch.lengths[i]) for i in ids))
    L = max(len(batch.prompts[i]) + int(batch.lengths[i]) for i in ids)
    input_ids = torch.full((len(ids), L), pad_id, dtype=torch.int64)
    attention = torch.zeros(len(ids), L, dtype=torch.int64)
    logit_pos = torch.zeros(len(ids), T, dtype=torch.int64)
    for row, i in enumerate(ids):
        p, n = len(batch.prompts[i]), int(batch.lengths[i])
        input_ids[row, :p] = torch.from_numpy(batch.prompts[i])
        input_ids[row, p : p + n] = batch.responses[i, :n]
        attention[row, : p + n] = 1
        # the logits at position p - 1 + t predict response token t
        logit_pos[row] = (torch.arange(T) + p - 1).clamp(max=L - 1)
    return MicroBatch(torch.tensor(ids, dtype=torch.int64), input_ids, attention, logit_pos, T)
