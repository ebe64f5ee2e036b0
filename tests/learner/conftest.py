from __future__ import annotations

import numpy as np

from fleetrl.broker.client.inproc import InprocBroker
from fleetrl.common import messages as m
from tests.broker.conftest import make_state


def synthetic_groups(
    n_groups: int, group_size: int = 4, vocab: int = 263, seed: int = 0, version: int = 0, logp: float = -2.0
) -> list[m.SampleGroup]:
    """Groups of random in-vocabulary responses of ragged lengths, rewards that differ within a group."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        responses, rewards = [], []
        for i in range(group_size):
            t = int(rng.integers(1, 7))
            responses.append((rng.integers(7, vocab, t), np.full(t, logp) + rng.normal(0, 0.1, t).clip(-1, 0)))
            rewards.append(float((i + g) % 2))
        groups.append(m.build_group(f"g{seed}-{g}", f"0:{g}", version, rng.integers(7, vocab, 6), responses, rewards))
    return groups


def inproc_client(groups: list[m.SampleGroup], *overrides: str):
    """An in-process broker holding ``groups`` (pushed without leases: an import); returns a learner client for it."""
    state = make_state(
        "broker.queue_capacity=100000",
        "broker.accept_unleased=true",
        *overrides,
        n_prompts=max(50, len(groups)),
        vocab_size=263,
    )
    broker = InprocBroker(state)
    rollout = broker.client("r0", "rollout")
    rollout.connect()
    for g in groups:
        assert rollout.push_groups([g])[0].status == "accepted"
    client = broker.client("learner-0", "learner")
    client.connect()
    return client, broker


def pack(groups: list[m.SampleGroup], max_tokens: int = 40):
    """The learner's packing of ``groups`` on the CPU (samples in group order)."""
    import torch

    from fleetrl.learner.batch import pack_groups

    return pack_groups(groups, max_tokens, torch.device("cpu"))


def samples(groups: list[m.SampleGroup]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt ids, response ids) of every sample, in the batch order of ``pack``."""
    return [
        (g.prompt_array().astype(np.int64), g.response_tokens(i).astype(np.int64))
        for g in groups
        for i in range(g.num_responses)
    ]
