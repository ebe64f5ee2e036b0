"""The pieces of the rollout loop: prompt encoding, finished groups, their SampleGroups, and the finisher.

The server's main thread leases prompts and hands each prompt's ``group_size`` requests to the
engine; as soon as a prompt's samples are all done it becomes a `Batch` (one group) whose rewards
the ``RewardScorer``'s workers score off the generation thread. The finisher thread takes every
batch that is ready, builds one ``SampleGroup`` per prompt, pushes them in one frame until
acknowledged, returns the prompts of dropped groups, writes one metrics line per frame, and tells
the server the groups are done (they count against ``rollout.max_inflight`` until then, so a slow
broker slows admission down instead of piling groups up in memory).

This module imports no torch: tests and `fleetrl eval` share its helpers cheaply.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetrl.broker.client.errors import BrokerError, BrokerUnavailable
from fleetrl.broker.client.roles import RolloutClient
from fleetrl.common import faults
from fleetrl.common import messages as m
from fleetrl.common.config import ConfigError
from fleetrl.rollout import group_rule as env_groups
from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.envs.base import Episode
from fleetrl.rollout.rewards import RewardInput, RewardResult
from fleetrl.rollout.rewards.scorer import RewardsHopeless
from fleetrl.rollout.tracing import LeaseTrace

log = logging.getLogger("fleetrl.rollout")


# ------------------------------------------------------------------------------------ prompts


def encode_prompt(
    tokenizer: Any, prompt: str | list[dict[str, str]], chat_template: bool, max_tokens: int
) -> list[int]:
    """Token ids of one prompt: the chat template applied (``data.apply_chat_template``) or the raw
    text, no special tokens besides those the template writes, truncated from the left.

    A prompt given as chat messages has no raw text form, so it always goes through the template.
    """
    if chat_template or not isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids[-max_tokens:]


def check_chat_template(tokenizer: Any, enabled: bool, where: str) -> None:
    """Refuse ``data.apply_chat_template: true`` with a tokenizer that has no template (at start-up)."""
    if enabled and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"data.apply_chat_template is true but the tokenizer of {where} has no chat template; "
            "set data.apply_chat_template=false (raw prompts) or use a tokenizer with a template"
        )


def trace_context(batch: Batch, prompt: m.Prompt, group_id: str) -> dict[str, str]:
    """The W3C trace context (traceparent, tracestate) one group carries; ``{}`` = none.

    The single hook for telemetry: when tracing is set up, this ends the ``prompt`` span that covers
    the prompt's lease, generation and reward (``rollout/tracing.py``) and returns its context.
    """
    return batch.trace.group(prompt.prompt_id, group_id) if batch.trace is not None else {}


# ------------------------------------------------------------------------------------ batches


@dataclass
class Batch:
    """Finished groups of one lease: their prompts (``lease.prompts``), samples and versions.

    ``version`` is what the engine held when the prompts were admitted; each sample's
    ``Generation.versions`` says which version sampled each of its tokens (a group's
    ``policy_version`` is the oldest of them).
    """

    lease: m.PromptLease
    prompt_ids: list[list[int]]
    samples: list[list[Generation]]  # [B][G]
    version: int
    gen_s: float
    rewards: Future  # -> list[RewardResult], flat [B * G]
    submitted: float = field(default_factory=time.monotonic)
    rewards_done: float = 0.0  # monotonic time the scorer finished (set by a callback)
    trace: LeaseTrace | None = None  # the lease's spans (None when tracing is off)
    baselines: list[Generation] | None = None  # [B] a greedy response per prompt (remax), scored after the samples

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for row in self.samples for s in row)


def reward_inputs(prompts: Sequence[m.Prompt], samples: Sequence[Sequence[Generation]]) -> list[RewardInput]:
    """One ``RewardInput`` per sample, prompt-major (the order of ``Batch.rewards``)."""
    return [
        RewardInput(
            prompt=p.prompt,
            response=s.text,
            answer=p.answer,
            metadata=dict(p.metadata),
            finish_reason=s.finish_reason,
            num_tokens=len(s.token_ids),
        )
        for p, row in zip(prompts, samples)
        for s in row
    ]


def build_groups(
    batch: Batch, results: Sequence[RewardResult], server_id: str, should_drop: Callable[[Sequence[RewardResult]], bool]
) -> tuple[list[m.SampleGroup], list[str], list[str]]:
    """The batch's groups, one per prompt; the prompt ids whose group is dropped (``should_drop``); and those
    no reward could score at all. A sample no reward scored (all returned None) is left out of its group."""
    groups, dropped, unscored = [], [], []
    at = 0
    sampled = sum(len(row) for row in batch.samples)
    baseline_rewards = [r.reward for r in results[sampled:]] if batch.baselines else None
    for b, (prompt, ids, samples) in enumerate(zip(batch.lease.prompts, batch.prompt_ids, batch.samples)):
        res = results[at : at + len(samples)]
        at += len(samples)
        samples, res = scored_only(samples, res)
        if not samples or should_drop(res):
            (dropped if samples else unscored).append(prompt.prompt_id)
            if batch.trace is not None:
                batch.trace.dropped(prompt.prompt_id)
            continue
        gid = uuid.uuid4().hex
        oldest, versions = group_versions(samples, batch.version)
        episodes = [s for s in samples if isinstance(s, Episode)]
        own = env_groups.own_prompts(samples, ids)
        shared = env_groups.shared_prompt(own)  # None: the samples' prompts differ, each keeps its own
        groups.append(
            m.build_group(
                gid,
                prompt.prompt_id,
                oldest,
                own if shared is None else shared,
                [(s.token_ids, s.logprobs) for s in samples],
                [r.reward for r in res],
                [s.finish_reason for s in samples],
                token_versions=versions,
                loss_masks=loss_masks(samples),
                per_sample_prompts=shared is None,
                reward_parts=[dict(r.parts) for r in res],
                failed=[r.failed for r in res],
                failed_parts=[list(r.failed_parts) for r in res] if any(r.failed_parts for r in res) else [],
                lease_id=batch.lease.lease_id,
                server_id=server_id,
                trace=trace_context(batch, prompt, gid),
                created_at=time.time(),
                baseline_reward=baseline_rewards[b] if baseline_rewards else None,
                metadata={
                    "server": server_id,
                    "gen_s": round(batch.gen_s, 4),
                    **({"turns": [e.turns for e in episodes]} if episodes else {}),
                },
            )
        )
    return groups, dropped, unscored


def scored_only(samples: Sequence[Generation], results: Sequence[RewardResult]) -> tuple[list, list]:
    """The samples (and results) some reward scored: an unscored sample is skipped, never trained as a 0."""
    keep = [j for j, r in enumerate(results) if r.scored]
    return [samples[j] for j in keep], [results[j] for j in keep]


def loss_masks(samples: Sequence[Generation]) -> list[list[int]] | None:
    """Per-sample loss masks when any sample is a multi-turn episode (None = every token trained, the wire's default)."""
    if not any(isinstance(s, Episode) for s in samples):
        return None
    return [s.loss_mask if isinstance(s, Episode) else [1] * len(s.token_ids) for s in samples]


def group_versions(samples: Sequence[Generation], admitted: int) -> tuple[int, list[list[int]] | None]:
    """A group's ``policy_version`` (its oldest token version; ``admitted`` when it has no token) and its
    per-token versions, or None when every token has that version (the wire's default)."""
    per_sample = [s.versions if len(s.versions) == len(s.token_ids) else [admitted] * len(s.token_ids) for s in samples]
    every = [v for versions in per_sample for v in versions]
    oldest = min(every, default=admitted)
    return oldest, (per_sample if any(v != oldest for v in every) else None)


# ------------------------------------------------------------------------------ leases, stats


class OpenLeases:
    """Prompts this server holds and has not pushed or returned, per lease (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, set[str]] = {}

    def add(self, lease: m.PromptLease) -> None:
        with self._lock:
            self._open[lease.lease_id] = {p.prompt_id for p in lease.prompts}

    def close(self, lease_id: str, prompt_ids: Sequence[str]) -> None:
        with self._lock:
            open_ids = self._open.get(lease_id)
            if open_ids is not None:
                open_ids.difference_update(prompt_ids)
                if not open_ids:
                    del self._open[lease_id]

    def take_all(self) -> dict[str, list[str]]:
        with self._lock:
            out = {lid: sorted(ids) for lid, ids in self._open.items()}
            self._open.clear()
        return out

    def __len__(self) -> int:
        with self._lock:
            return sum(len(ids) for ids in self._open.values())


class Stats:
    """Counters of one server, read by heartbeats (client thread) and metrics (finisher thread)."""

    COUNTERS = (
        "batches",
        "groups_pushed",
        "groups_dropped",
        "groups_unscored",
        "groups_stale",
        "groups_rejected",
        "prompts_returned",
        "tokens",
        "throttles",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals = dict.fromkeys(self.COUNTERS, 0)
        self.throttled_s = 0.0  # since the previous batch record
        self.tokens_per_s = 0.0
        self.reward_mean = 0.0

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.totals[k] += v

    def throttled(self, seconds: float) -> None:
        with self._lock:
            self.throttled_s += seconds
            self.totals["throttles"] += 1

    def take_throttled(self) -> float:
        with self._lock:
            out, self.throttled_s = self.throttled_s, 0.0
        return out

    def batch_done(self, tokens_per_s: float, reward_mean: float) -> None:
        with self._lock:
            self.tokens_per_s, self.reward_mean = tokens_per_s, reward_mean

    def heartbeat(self) -> dict[str, float]:
        with self._lock:
            out = {f"rollout/{k}": float(v) for k, v in self.totals.items()}
            out["rollout/tokens_per_s"] = self.tokens_per_s
            out["reward/mean"] = self.reward_mean
        return out


class MetricsFile:
    """One JSON line per batch (``<run-dir>/rollout-<i>.metrics.jsonl``); a no-op without a path."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------------- finisher


@dataclass
class GiveBack:
    """Prompts of one lease that go back to the broker without a group (`Finisher.give_back`)."""

    lease_id: str
    prompt_ids: list[str]


class Finisher:
    """The background thread that scores, pushes and records finished groups (see the module docstring).

    ``error`` holds the exception that stopped it (the broker became unreachable); the main loop
    raises it. ``close()`` finishes every submitted batch; ``abandon()`` stops without finishing.
    ``on_done(batch)`` runs (on this thread) once a batch is pushed, dropped or refused (``None``: once per
    prompt given back).
    """

    def __init__(
        self,
        client: RolloutClient,
        scorer: Any,
        server_id: str,
        leases: OpenLeases,
        stats: Stats,
        metrics: MetricsFile,
        push_deadline_s: float,
        extra_metrics: Callable[[], dict[str, float]],
        on_done: Callable[[Batch | None], None] | None = None,
        fingerprint: Callable[[], Any] = lambda: None,
    ):
        self.client, self.scorer, self.server_id = client, scorer, server_id
        self.fingerprint = fingerprint  # -> [version, dtype, names, fp] of the engine's weights now, or None
        self.leases, self.stats, self.metrics = leases, stats, metrics
        self.push_deadline_s, self.extra_metrics = push_deadline_s, extra_metrics
        self.on_done = on_done or (lambda batch: None)
        # the ids the broker acknowledged, one line per push (what the chaos checker holds the broker to)
        self.acked = MetricsFile(
            metrics.path.with_name(metrics.path.name.replace(".metrics.", ".acked.")) if metrics.path else None
        )
        self.error: BaseException | None = None
        self._queue: queue.Queue[Batch | GiveBack | None] = queue.Queue()
        self._abandon = threading.Event()
        self._last_record = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"finisher-{server_id}", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch) -> None:
        """Hand finished groups over (returns at once; the server's in-flight budget bounds the queue)."""
        if self.error is not None:
            raise self.error
        batch.rewards.add_done_callback(lambda _: setattr(batch, "rewards_done", time.monotonic()))
        self._queue.put(batch)

    def give_back(self, lease_id: str, prompt_ids: list[str]) -> None:
        """Return prompts that make no group (their generation failed, too few samples survived); ``on_done``
        runs once per prompt, as for a pushed batch of one."""
        self._queue.put(GiveBack(lease_id, list(prompt_ids)))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def abandon(self) -> None:
        self._abandon.set()

    def _run(self) -> None:
        while not self._abandon.is_set():
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            batches, closing = [first], first is None
            while not closing:  # everything ready now goes in one push frame
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                closing = more is None
                batches.append(more)
            if self._abandon.is_set():
                return
            backs = [b for b in batches if isinstance(b, GiveBack)]
            batches = [b for b in batches if isinstance(b, Batch)]
            try:
                for back in backs:
                    self.return_prompts(back)
                if batches:
                    self.finish_all(batches)
            except BaseException as e:  # noqa: BLE001 - reported to the main loop, which exits on it
                self.error = e
                return
            if closing:
                return

    def return_prompts(self, back: GiveBack) -> None:
        try:
            self.client.return_prompts(back.lease_id, back.prompt_ids)
            self.stats.add(prompts_returned=len(back.prompt_ids))
        except (BrokerError, BrokerUnavailable) as e:
            log.warning(
                "could not return prompt(s) %s (%s); the broker re-issues them when their lease expires",
                ", ".join(back.prompt_ids),
                e,
            )
        self.leases.close(back.lease_id, back.prompt_ids)
        for _ in back.prompt_ids:
            self.on_done(None)

    def finish(self, batch: Batch) -> None:
        """One batch alone (see `finish_all`)."""
        self.finish_all([batch])

    def finish_all(self, batches: list[Batch]) -> None:
        """Wait for the batches' rewards, push their groups in one frame until acknowledged, return
        dropped and refused prompts, write one metrics line."""
        built = []
        for batch in batches:
            results = batch.rewards.result()
            groups, dropped, unscored = build_groups(batch, results, self.server_id, self.scorer.should_drop)
            groups = faults.at("rollout.groups", groups)  # FLEETRL_FAULT=poison_server (benchmarks); off by default
            held = self.fingerprint()
            for g in groups if held is not None else ():  # the learner's stale_weights rule compares it
                g.metadata["weights_fp"] = held
            results = results[: sum(len(row) for row in batch.samples)]  # the greedy baselines are not samples
            if dropped:
                self.client.return_prompts(batch.lease.lease_id, dropped)
                self.leases.close(batch.lease.lease_id, dropped)
                self.stats.add(groups_dropped=len(dropped), prompts_returned=len(dropped))
            if unscored:  # no reward scored any of its samples: the broker counts them and does not re-issue them
                self.client.return_prompts(batch.lease.lease_id, unscored, unscored=True)
                self.leases.close(batch.lease.lease_id, unscored)
                self.stats.add(groups_unscored=len(unscored))
            built.append((batch, results, groups))
        groups = [g for _, _, gs in built for g in gs]
        t0 = time.monotonic()
        refused: list[str] = []
        counts = self.push(groups, refused) if groups else {}
        push_s = time.monotonic() - t0
        refused_set = set(refused)
        for batch, _, gs in built:
            back = [g.prompt_id for g in gs if g.prompt_id in refused_set]
            if back:  # regenerate them now rather than when the lease expires
                self.client.return_prompts(batch.lease.lease_id, back)
                self.stats.add(prompts_returned=len(back))
            if batch.trace is not None:
                ids = [p.prompt_id for p in batch.lease.prompts]
                batch.trace.record("rollout.reward", batch.submitted, batch.rewards_done or t0, ids)
                batch.trace.record("rollout.push", t0, t0 + push_s, ids, groups=len(gs))
            self.leases.close(batch.lease.lease_id, [g.prompt_id for g in gs])
            self.on_done(batch)
        self.stats.add(batches=len(batches), tokens=sum(b.num_tokens for b in batches), **counts)
        self.metrics.write(self.record(batches, [r for _, results, _ in built for r in results], push_s))
        if (
            why := self.scorer.hopeless()
        ) is not None:  # the last N samples failed or unscored: stop, naming the rewards
            raise RewardsHopeless(why)

    def push(self, groups: list[m.SampleGroup], refused: list[str]) -> dict[str, int]:
        """Push in one frame (retried until acked); counts by outcome. Refused groups are logged and their
        prompt ids appended to ``refused``.

        The broker refuses a whole frame that is too large or holds a group it cannot decode; the groups
        then go one a frame, so that one bad group costs only itself.
        """
        try:
            acks = self.client.push_groups(groups, deadline_s=self.push_deadline_s)
        except BrokerError as e:
            if len(groups) > 1:
                return self._push_one_by_one(groups, refused)
            log.error("the broker refused group %s (%s); its prompt goes back to the broker", groups[0].group_id, e)
            refused.append(groups[0].prompt_id)
            return {"groups_rejected": 1}
        counts = {"groups_pushed": 0, "groups_stale": 0, "groups_rejected": 0}
        prompts = {g.group_id: g.prompt_id for g in groups}
        self.acked.write({"time": time.time(), "group_ids": [a.group_id for a in acks if a.status == "accepted"]})
        for ack in acks:
            if ack.status in ("accepted", "duplicate"):
                counts["groups_pushed"] += 1
            elif ack.status == "stale":
                counts["groups_stale"] += 1
            else:
                counts["groups_rejected"] += 1
                refused.append(prompts[ack.group_id])
                log.error("the broker rejected group %s: %s", ack.group_id, ack.reason)
        return counts

    def _push_one_by_one(self, groups: list[m.SampleGroup], refused: list[str]) -> dict[str, int]:
        total: dict[str, int] = {}
        for g in groups:
            for k, v in self.push([g], refused).items():
                total[k] = total.get(k, 0) + v
        return total

    def record(self, batches: list[Batch], results: Sequence[RewardResult], push_s: float) -> dict[str, Any]:
        """The metrics line of one push frame (namespaced keys); tokens/s over the time since the last line."""
        rewards = [r.reward for r in results if r.scored]
        samples = [s for b in batches for row in b.samples for s in row]
        lengths = [len(s.token_ids) for s in samples]
        versions = [v for s in samples for v in s.versions]
        truncated = sum(s.finish_reason == "length" for s in samples)
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        now = time.monotonic()
        window, self._last_record = now - self._last_record, now
        tokens_per_s = sum(lengths) / window if window > 0 else 0.0
        self.stats.batch_done(tokens_per_s, mean)
        totals = self.stats.heartbeat()
        return {
            "time": time.time(),
            **self.scorer.stats(),
            **self.extra_metrics(),
            **totals,
            "rollout/policy_version": min((b.version for b in batches), default=0),
            "rollout/token_version_min": min(versions, default=0),
            "rollout/token_version_max": max(versions, default=0),
            "rollout/prompts": sum(len(b.samples) for b in batches),
            "rollout/response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "rollout/response_len_max": max(lengths, default=0),
            "rollout/truncated_frac": truncated / len(lengths) if lengths else 0.0,
            "rollout/throttled_s": self.stats.take_throttled(),
            "reward/mean": mean,
            "reward/max": max(rewards, default=0.0),
            "reward/min": min(rewards, default=0.0),
            "timing/generate_s": sum(b.gen_s for b in batches) / len(batches),
            "timing/reward_s": max(0.0, max((b.rewards_done or now) - b.submitted for b in batches)),
            "timing/push_s": push_s,
        }


def return_leases(client: RolloutClient, leases: OpenLeases, stats: Stats) -> int:
    """Give every open prompt back to the broker (shutdown); returns how many it re-issues."""
    returned = 0
    for lease_id, prompt_ids in leases.take_all().items():
        try:
            returned += client.return_prompts(lease_id, prompt_ids).count
        except (BrokerError, BrokerUnavailable) as e:
            log.warning("could not return lease %s (%s); the broker re-issues it when it expires", lease_id, e)
    stats.add(prompts_returned=returned)
    return returned
