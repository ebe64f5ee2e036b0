"""One learner step's samples, packed once onto the device: rollout batches and preference batches.

Shape legend: B samples of the step, T the longest response (every token after the prompt), b / L a
micro-batch's samples / padded length (prompt + response), P preference pairs.

One planning step per learner step turns the leased groups into micro-batches of at most
``learner.max_tokens_per_microbatch`` padded tokens, each right-padded only to its own longest
sequence and moved to the device once. Every pass of the step (the old / reference log-probs, the
critic's values, each epoch and mini-batch of the update) reuses them; what a pass computes is
stored on the micro-batch, on the device. Advantages need whole groups, so they are computed on
``[B, T]`` views gathered from the micro-batches and scattered back.

    batch = pack_groups(groups, max_tokens, device, order)      # RolloutBatch
    for mb in batch.micro: mb.input_ids, mb.targets, mb.mask, mb.behav_logp, mb.old_logp, mb.adv ...
    pairs = pack_pairs(pairs, max_tokens, device)                # PreferenceBatch (DPO)

Each sample is packed after its own prompt: the group's shared prompt, or the prompt it carries itself
(``SampleGroup.prompt_lengths``, agent sessions whose prompts differ), so the learner trains exactly
the context the engine saw. A sample's ``mask`` is its loss mask: 1 on tokens the policy sampled, 0 on tokens appended to the
sequence without being sampled (a multi-turn episode's observations, ``SampleGroup.loss_mask``) and
on padding. Holes inside a response are fine everywhere: advantages, losses, KL and aggregation all
read the mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fleetrl.common.messages import SampleGroup


@dataclass
class SharedPrompts:
    """A micro-batch's distinct prompts, forwarded once (``learner.shared_prompts``): row r's response
    attends to the keys and values of prompt ``row_prompt[r]`` (learner/update.py: response_logprobs).

    Prompts are right-padded to P; ``response_ids`` are the rows' response tokens as inputs, ``[b, T - 1]``
    (the last one predicts nothing; token 0 is predicted by the prompt's last position)."""

    prompt_ids: torch.Tensor  # [u, P]
    prompt_mask: torch.Tensor  # [u, P]
    prompt_len: torch.Tensor  # [u]
    row_prompt: torch.Tensor  # [b] index into the u prompts
    response_ids: torch.Tensor  # [b, T - 1]
    response_mask: torch.Tensor  # [b, T - 1]


@dataclass
class MicroBatch:
    """Samples ``index`` of a batch as one right-padded forward pass; every tensor is on the device.

    ``logit_pos[r, t]`` is the position whose logits predict response token t of row r (the prompt's
    last position for t = 0), clamped where the row is shorter; ``targets`` are those tokens.
    """

    index: torch.Tensor  # [b] positions in the batch (CPU)
    input_ids: torch.Tensor  # [b, L]
    attention_mask: torch.Tensor  # [b, L]
    logit_pos: torch.Tensor  # [b, T]
    targets: torch.Tensor  # [b, T] response token ids (0 beyond a row's length)
    mask: torch.Tensor  # [b, T] float loss mask
    behav_logp: torch.Tensor  # [b, T] the engine's log-probs of the sampled tokens
    response_len: int  # T of this micro-batch
    token_versions: torch.Tensor | None = None  # [b, T] int64 policy version that sampled each token (-1 padding)
    old_logp: torch.Tensor | None = None  # [b, T] filled by the step's passes
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    shared: SharedPrompts | None = None  # set when rows share prompts and learner.shared_prompts is on

    @property
    def size(self) -> int:
        return int(self.index.numel())

    @property
    def num_tokens(self) -> float:
        return float(self.mask.sum())


@dataclass
class RolloutBatch:
    """A step's rewarded samples: micro-batches plus the ``[B]`` / ``[B, T]`` tensors of the whole batch.

    ``mask`` ``[B, T]`` is the loss mask (on the device); the ``[B]`` tensors are on the device too.
    ``last`` is each sample's last trained token (where an outcome reward is placed), -1 for none.
    """

    micro: list[MicroBatch]
    mask: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [B] float32
    group_index: torch.Tensor  # [B] int64
    versions: torch.Tensor  # [B] int64 oldest policy version of the sample's tokens
    lengths: torch.Tensor  # [B] int64 response tokens (sampled and appended)
    last: torch.Tensor  # [B] int64
    truncated: torch.Tensor  # [B] bool: finish_reason == "length"
    baselines: torch.Tensor | None = None  # [B] greedy-response reward (remax)
    group_ids: list[str] = field(default_factory=list)
    traces: list[dict[str, str]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def gather(self, name: str) -> torch.Tensor:
        """The micro-batches' ``name`` field as one ``[B, T]`` tensor (0 where masked or absent)."""
        out = torch.zeros_like(self.mask)
        for mb in self.micro:
            out[mb.index.to(out.device), : mb.response_len] = getattr(mb, name)
        return out * self.mask

    def scatter(self, name: str, x_BT: torch.Tensor) -> None:
        """Store each micro-batch's rows of ``x_BT`` ``[B, T]`` as its ``name`` field."""
        for mb in self.micro:
            setattr(mb, name, x_BT[mb.index.to(x_BT.device), : mb.response_len])


@dataclass
class _Sample:
    prompt: np.ndarray  # int64 [p]
    response: np.ndarray  # int64 [n]
    mask: np.ndarray  # float32 [n]
    logp: np.ndarray  # float32 [n]
    versions: np.ndarray | None = None  # int32 [n] the policy version that sampled each token

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.response)


def plan_micro_batches(totals: Sequence[int], order: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sample indices (taken in ``order``, then stably sorted by total length) cut into runs of at most
    ``max_tokens`` padded tokens; a sample longer than the budget gets a run of its own."""
    ids = sorted(order, key=lambda i: totals[i])
    runs: list[list[int]] = []
    for i in ids:
        if runs and (len(runs[-1]) + 1) * totals[i] <= max_tokens:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _shared_prompts(
    samples: list[_Sample], ids: list[int], targets: np.ndarray, pad_id: int = 0
) -> dict[str, np.ndarray] | None:
    """The micro-batch's distinct prompts (token for token) and each row's, or None when no two rows share one.
    ``targets`` ``[b, T]``: the rows' response tokens, 0 beyond each row's length (the response inputs)."""
    index: dict[bytes, int] = {}
    firsts: list[int] = []  # a sample of each distinct prompt
    row_prompt = np.empty(len(ids), dtype=np.int64)
    for row, i in enumerate(ids):
        k = index.setdefault(samples[i].prompt.tobytes(), len(index))
        if k == len(firsts):
            firsts.append(i)
        row_prompt[row] = k
    if len(firsts) == len(ids):
        return None
    P = max(len(samples[i].prompt) for i in firsts)
    prompt_ids = np.full((len(firsts), P), pad_id, dtype=np.int64)
    prompt_mask = np.zeros((len(firsts), P), dtype=np.int64)
    for k, i in enumerate(firsts):
        p = len(samples[i].prompt)
        prompt_ids[k, :p] = samples[i].prompt
        prompt_mask[k, :p] = 1
    T = targets.shape[1]
    lengths = np.array([len(samples[i].response) for i in ids])
    response_mask = (np.arange(T - 1) < lengths[:, None]).astype(np.int64)
    response_ids = np.where(response_mask > 0, targets[:, : T - 1], pad_id)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "prompt_len": prompt_mask.sum(1),
        "row_prompt": row_prompt,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def _to_micro(
    samples: list[_Sample], ids: list[int], device: torch.device, pad_id: int = 0, share: bool = False
) -> MicroBatch:
    T = max(1, max(len(samples[i].response) for i in ids))
    L = max(samples[i].total for i in ids)
    b = len(ids)
    input_ids = np.full((b, L), pad_id, dtype=np.int64)  # filled in numpy, moved to torch once per tensor
    attention = np.zeros((b, L), dtype=np.int64)
    logit_pos = np.empty((b, T), dtype=np.int64)
    targets = np.zeros((b, T), dtype=np.int64)
    mask = np.zeros((b, T), dtype=np.float32)
    behav = np.zeros((b, T), dtype=np.float32)
    versions = np.full((b, T), -1, dtype=np.int64)
    steps = np.arange(T)
    for row, i in enumerate(ids):
        s = samples[i]
        p, n = len(s.prompt), len(s.response)
        input_ids[row, :p] = s.prompt
        input_ids[row, p : p + n] = s.response
        attention[row, : p + n] = 1
        np.minimum(steps + (p - 1), L - 1, out=logit_pos[row])  # the logits at p - 1 + t predict token t
        targets[row, :n] = s.response
        mask[row, :n] = s.mask
        behav[row, :n] = s.logp
        if s.versions is not None:
            versions[row, :n] = s.versions
    put = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    shared = _shared_prompts(samples, ids, targets, pad_id) if share else None
    return MicroBatch(
        torch.tensor(ids, dtype=torch.int64),
        put(input_ids),
        put(attention),
        put(logit_pos),
        put(targets),
        put(mask),
        put(behav),
        T,
        token_versions=put(versions),
        shared=SharedPrompts(**{k: put(v) for k, v in shared.items()}) if shared is not None else None,
    )


def _samples_of(groups: list[SampleGroup]) -> tuple[list[_Sample], dict[str, list]]:
    samples: list[_Sample] = []
    cols: dict[str, list] = {k: [] for k in ("rewards", "group_index", "versions", "truncated", "baselines")}
    for gi, g in enumerate(groups):
        prompt = g.prompt_array().astype(np.int64)
        tokens, lps = g.token_array().astype(np.int64), g.logprob_array()  # one conversion per group;
        masks, offsets = g.loss_mask_array().astype(np.float32), g.offsets()  # samples are views into it
        versions, poffsets = g.version_array(), g.prompt_offsets()  # poffsets: per-sample prompts, or None
        baseline = g.baseline_reward
        for i in range(g.num_responses):
            a, b = offsets[i], offsets[i + 1]
            own = prompt if poffsets is None else prompt[poffsets[i] : poffsets[i + 1]]
            samples.append(_Sample(own, tokens[a:b], masks[a:b], lps[a:b], versions[a:b]))
            cols["rewards"].append(g.rewards[i])
            cols["group_index"].append(gi)
            cols["versions"].append(g.policy_version)
            cols["truncated"].append(g.finish_reason(i) == "length")
            cols["baselines"].append(float("nan") if baseline is None else float(baseline))
    return samples, cols


def pack_groups(
    groups: list[SampleGroup],
    max_tokens: int,
    device: torch.device,
    order: torch.Tensor | None = None,
    min_micro: int = 1,
    share_prompts: bool = False,
) -> RolloutBatch:
    """The one planning step of a learner step: leased groups -> micro-batches on ``device``.

    ``order``: the permutation samples are taken in before the stable sort by length (the learner
    draws it from its seeded generator). ``min_micro``: at least this many micro-batches (one per
    mini-batch), splitting the budget's runs when there are fewer. ``share_prompts``: micro-batches whose
    rows share prompts also carry them once (``MicroBatch.shared``).
    """
    samples, cols = _samples_of(groups)
    B = len(samples)
    order_ = order.tolist() if order is not None else list(range(B))
    totals = [s.total for s in samples]
    runs = plan_micro_batches(totals, order_, max_tokens)
    while len(runs) < min(min_micro, B):  # one micro-batch per mini-batch at least: split the largest run
        k = max(range(len(runs)), key=lambda j: len(runs[j]))
        runs[k : k + 1] = [runs[k][: len(runs[k]) // 2], runs[k][len(runs[k]) // 2 :]]
    micro = [_to_micro(samples, run, device, share=share_prompts) for run in runs]
    T = max(1, max((len(s.response) for s in samples), default=1))
    mask_np = np.zeros((B, T), dtype=np.float32)
    for b, s in enumerate(samples):
        mask_np[b, : len(s.response)] = s.mask
    mask = torch.from_numpy(mask_np)
    lengths = torch.tensor([len(s.response) for s in samples], dtype=torch.int64)
    has = mask.sum(-1) > 0
    last = torch.where(has, T - 1 - torch.flip(mask, dims=[1]).argmax(-1), -1)
    baselines = torch.tensor(cols["baselines"], dtype=torch.float32)
    return RolloutBatch(
        micro,
        mask.to(device),
        torch.tensor(cols["rewards"], dtype=torch.float32).to(device),
        torch.tensor(cols["group_index"], dtype=torch.int64).to(device),
        torch.tensor(cols["versions"], dtype=torch.int64).to(device),
        lengths.to(device),
        last.to(device),
        torch.tensor(cols["truncated"], dtype=torch.bool).to(device),
        None if torch.isnan(baselines).all() else baselines.to(device),
        [g.group_id for g in groups],
        [g.trace for g in groups],
    )


# ------------------------------------------------------------------------------ preference pairs


@dataclass
class PairChunk:
    """``n`` whole pairs as one micro-batch of 2n sequences (rows in length order).

    ``rows[j]`` is the micro-batch row of sequence j, where sequences 0..n-1 are the chunk's chosen
    responses and n..2n-1 its rejected ones, in pair order.
    """

    mb: MicroBatch
    rows: torch.Tensor  # [2n] on the device
    pairs: torch.Tensor  # [n] pair indices in the batch (CPU)
    lengths: torch.Tensor  # [2n] response lengths, float, on the device
    ref_sum: torch.Tensor | None = None  # [2n] summed reference log-probs, filled by the reference pass

    @property
    def n(self) -> int:
        return int(self.pairs.numel())


@dataclass
class PreferenceBatch:
    """A step's preference pairs (offline from ``data.preference``, online best vs worst of each group)."""

    chunks: list[PairChunk]
    num_pairs: int
    tied: int = 0  # online: groups whose rewards all tie (no pair)
    lengths: torch.Tensor | None = None  # [2P] response lengths (CPU)
    group_ids: list[str] = field(default_factory=list)
    rewards: torch.Tensor | None = None  # online: [B] rewards of the leased samples (CPU)
    versions: torch.Tensor | None = None  # online: [B]
    truncated: torch.Tensor | None = None  # online: [B]
    num_samples: int = 0
    num_tokens: int = 0


def pair_chunks(lengths: Sequence[int], n_pairs: int, max_tokens: int) -> list[list[int]]:
    """Pair indices 0..P-1 cut into runs whose 2k sequences fit ``max_tokens`` padded tokens.

    ``lengths`` holds the P chosen totals first, then the P rejected ones. A pair longer than the
    budget gets a run of its own.
    """
    runs: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for p in range(n_pairs):
        pair_len = max(lengths[p], lengths[n_pairs + p])
        if current and 2 * (len(current) + 1) * max(longest, pair_len) > max_tokens:
            runs.append(current)
            current, longest = [], 0
        current.append(p)
        longest = max(longest, pair_len)
    if current:
        runs.append(current)
    return runs


def pack_pairs(
    pairs: Sequence[tuple[Sequence[int], ...]], max_tokens: int, device: torch.device, **fields
) -> PreferenceBatch:
    """``(prompt ids, chosen ids, rejected ids)`` pairs -> chunks of whole pairs on ``device``. A fourth
    element, when given, is the rejected response's own prompt (a group with per-sample prompts)."""
    P = len(pairs)
    sides = [(x[0], x[1]) for x in pairs] + [(x[3] if len(x) > 3 else x[0], x[2]) for x in pairs]
    samples = [
        _Sample(
            np.asarray(p, dtype=np.int64),
            np.asarray(r, dtype=np.int64),
            np.ones(len(r), np.float32),
            np.zeros(len(r), np.float32),
        )
        for p, r in sides
    ]
    totals = [s.total for s in samples]
    chunks = []
    for run in pair_chunks(totals, P, max_tokens):
        seqs = run + [P + k for k in run]  # chosen then rejected, in pair order
        mb = _to_micro(samples, sorted(seqs, key=lambda i: totals[i]), device)  # rows in length order
        row_of = {int(i): r for r, i in enumerate(mb.index.tolist())}
        rows = torch.tensor([row_of[i] for i in seqs], dtype=torch.int64, device=device)
        lens = torch.tensor([len(samples[i].response) for i in seqs], dtype=torch.float32, device=device)
        chunks.append(PairChunk(mb, rows, torch.tensor(run, dtype=torch.int64), lens))
    lengths = torch.tensor([len(s.response) for s in samples], dtype=torch.int64)
    return PreferenceBatch(chunks, P, lengths=lengths, num_tokens=int(lengths.sum()), **fields)
