"""The rows the `hf` engine decodes together (continuous batching): their KV cache, attention mask,
positions and what each row has sampled, with the two operations that change the set of rows:
`Rows.merge` (freshly prefilled rows join) and `Rows.keep` (finished rows leave at once).

Layout: rows are right-aligned. Every row's newest token sits in the cache's last column T-1 and its
earlier context fills the columns before it; the columns left of a row's context are padding (mask
0, zero keys and values). A row's positions are its own (0 .. len-1 over its context, whatever its
padding), so a row reads the same keys at the same positions whatever rows it shares the batch with.
Merging left-pads the shorter cache; leaving trims the columns that are padding in every row left.

Shape legend: R rows, T cache columns, M token slots per row (the longest budget), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.sampling import _Job

Groups = list[tuple[SamplingParams, "torch.Tensor | slice"]]


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's layers, each a plain `DynamicLayer` (a sliding-window layer drops columns itself,
    so rows of different lengths cannot be aligned by padding)."""
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"hf engine: continuous batching needs plain DynamicCache layers, this model's cache has "
                f"{type(layer).__name__}; set rollout.hf.continuous=false"
            )
    return cache.layers


def pad_left(cache: DynamicCache, columns: int) -> None:
    """Prepend ``columns`` zero key / value columns to every layer ([R, heads, T, dim] -> T + columns)."""
    if columns:
        for layer in _layers(cache):
            layer.keys = F.pad(layer.keys, (0, 0, columns, 0))
            layer.values = F.pad(layer.values, (0, 0, columns, 0))


def trim_left(cache: DynamicCache, columns: int) -> None:
    """Drop the first ``columns`` columns of every layer."""
    if columns:
        for layer in _layers(cache):
            layer.keys, layer.values = layer.keys[:, :, columns:], layer.values[:, :, columns:]


def cat_rows(cache: DynamicCache, other: DynamicCache) -> None:
    """Append ``other``'s rows to ``cache``'s (both as long already)."""
    for layer, new in zip(_layers(cache), _layers(other), strict=True):
        layer.keys = torch.cat([layer.keys, new.keys])
        layer.values = torch.cat([layer.values, new.values])


def groups_of(jobs: list[_Job], device: torch.device) -> Groups:
    """The rows that share sampling settings (`_Job.key`), each key with its rows (a slice when one
    key covers every row: no gather in the common case)."""
    keys = [job.key for job in jobs]
    distinct = list(dict.fromkeys(keys))
    if len(distinct) == 1:
        return [(distinct[0], slice(None))]
    return [(key, torch.tensor([i for i, k in enumerate(keys) if k == key], device=device)) for key in distinct]


@dataclass
class Rows:
    """The rows being decoded; ``jobs[r]`` is row r's request. Row r has sampled ``steps_R[r]`` tokens
    (``tokens_RM[r, :steps]``) since it joined; ``logits_RV`` are the logits its next token is drawn from."""

    jobs: list[_Job]
    cache: DynamicCache | None
    mask_RT: torch.Tensor  # 1 over each row's own columns
    pos_R: torch.Tensor  # position of the next token fed (the row's context length)
    limit_R: torch.Tensor  # most tokens the row may sample (its budget or what the context length leaves)
    steps_R: torch.Tensor
    tokens_RM: torch.Tensor
    logp_RM: torch.Tensor
    version_RM: torch.Tensor  # the policy version that sampled each token
    logits_RV: torch.Tensor | None  # None after `keep`, until the next step computes them
    groups: Groups

    @classmethod
    def empty(cls, device: torch.device) -> Rows:
        long = torch.zeros(0, dtype=torch.long, device=device)
        return cls(
            [],
            None,
            long[:, None],
            long,
            long,
            long,
            long[:, None],
            long[:, None].float(),
            long[:, None],
            long[:, None].float(),
            [],
        )

    @classmethod
    def start(
        cls,
        jobs: list[_Job],
        cache: DynamicCache,
        mask_RT: torch.Tensor,
        length_R: torch.Tensor,
        limit_R: torch.Tensor,
        logits_RV: torch.Tensor,
    ) -> Rows:
        """Rows fresh from a prefill: nothing sampled yet, M = the longest budget."""
        device, width = mask_RT.device, max(job.budget for job in jobs)
        zeros = torch.zeros(len(jobs), width, dtype=torch.long, device=device)
        return cls(
            jobs,
            cache,
            mask_RT,
            length_R,
            limit_R,
            torch.zeros_like(length_R),
            zeros,
            zeros.float(),
            zeros.clone(),
            logits_RV,
            groups_of(jobs, device),
        )

    def __len__(self) -> int:
        return len(self.jobs)

    def record(self, token_R: torch.Tensor, logp_R: torch.Tensor, version: int) -> None:
        """Write each row's newly sampled token, its log-prob and version at the row's own step."""
        at = (torch.arange(len(self), device=token_R.device), self.steps_R)
        self.tokens_RM[at], self.logp_RM[at], self.version_RM[at] = token_R, logp_R, version
        self.steps_R = self.steps_R + 1

    def sampled(self, row: int) -> tuple[list[int], list[float], list[int]]:
        """Row ``row``'s tokens, log-probs and versions since it joined."""
        steps = int(self.steps_R[row])
        return (
            self.tokens_RM[row, :steps].tolist(),
            self.logp_RM[row, :steps].tolist(),
            self.version_RM[row, :steps].tolist(),
        )

    def last_tokens(self, index: torch.Tensor | slice, k: int) -> list[list[int]]:
        """The last ``k`` (or fewer) tokens each row of ``index`` sampled since it joined."""
        steps = self.steps_R[index].tolist()
        start = max(0, min(steps) - k)
        block = self.tokens_RM[index, start : max(steps)].tolist()
        return [tokens[max(0, n - k) - start : n - start] for tokens, n in zip(block, steps)]

    def merge(self, new: Rows) -> Rows:
        """These rows, then ``new``'s: the shorter cache is left-padded so that both stay right-aligned."""
        if not self.jobs:
            return new
        assert self.cache is not None and new.cache is not None
        assert self.logits_RV is not None and new.logits_RV is not None
        columns = max(self.mask_RT.shape[1], new.mask_RT.shape[1])
        width = max(self.tokens_RM.shape[1], new.tokens_RM.shape[1])
        for rows in (self, new):
            missing = columns - rows.mask_RT.shape[1]
            pad_left(rows.cache, missing)
            rows.mask_RT = F.pad(rows.mask_RT, (missing, 0))
        cat_rows(self.cache, new.cache)
        slots = [
            torch.cat([F.pad(a, (0, width - a.shape[1])), F.pad(b, (0, width - b.shape[1]))])
            for a, b in (
                (self.tokens_RM, new.tokens_RM),
                (self.logp_RM, new.logp_RM),
                (self.version_RM, new.version_RM),
            )
        ]
        jobs = self.jobs + new.jobs
        return Rows(
            jobs,
            self.cache,
            torch.cat([self.mask_RT, new.mask_RT]),
            torch.cat([self.pos_R, new.pos_R]),
            torch.cat([self.limit_R, new.limit_R]),
            torch.cat([self.steps_R, new.steps_R]),
            *slots,
            torch.cat([self.logits_RV, new.logits_RV]),
            groups_of(jobs, self.mask_RT.device),
        )

    def keep(self, keep_R: torch.Tensor) -> Rows:
        """Only the rows where ``keep_R``; then the columns that are padding in every row left go. Called
        between sampling and the next step, so the logits are not carried (None)."""
        index = keep_R.nonzero().squeeze(1)
        if index.numel() == 0:
            return Rows.empty(keep_R.device)
        assert self.cache is not None
        self.cache.batch_select_indices(index)
        mask_RT = self.mask_RT[index]
        first = int(mask_RT.any(dim=0).long().argmax())  # the first column some row still reads
        trim_left(self.cache, first)
        jobs = [self.jobs[i] for i in index.tolist()]
        return Rows(
            jobs,
            self.cache,
            mask_RT[:, first:],
            self.pos_R[index],
            self.limit_R[index],
            self.steps_R[index],
            self.tokens_RM[index],
            self.logp_RM[index],
            self.version_RM[index],
            None,
            groups_of(jobs, keep_R.device),
        )
