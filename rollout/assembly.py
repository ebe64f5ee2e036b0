"""Group assembly for one rollout server: a prompt's finished samples become one scored `Batch`.

A prompt's ``group_size`` samples (plus, for ReMax, one greedy baseline) are done: keep the samples the
environment's group rules let through (`rollout/group_rule.py`), settle the group's sessions, start the
rewards (scorer threads) and hand back the `Batch` the finisher pushes (each sample keeps the prompt it
followed: `build_groups`). ``None`` means the prompt goes back to the broker (too few samples survived, no
agent took the tasks); the reason is logged here and told to the environment.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig
from fleetrl.rollout import group_rule as env_groups
from fleetrl.rollout.engines import SamplingParams
from fleetrl.rollout.envs import Environment
from fleetrl.rollout.inflight import InFlight
from fleetrl.rollout.loop import Batch, reward_inputs
from fleetrl.rollout.tracing import genai_attributes

log = logging.getLogger("fleetrl.rollout")


class GroupAssembly:
    def __init__(
        self,
        cfg: JobConfig,
        env: Environment,
        scorer: Any,
        client_id: str,
        params: SamplingParams,
        greedy_baseline: bool,
    ):
        self.cfg, self.env, self.scorer, self.client_id = cfg, env, scorer, client_id
        self.params, self.greedy_baseline = params, greedy_baseline

    def build(self, key: int, item: InFlight, closing: bool = False) -> Batch | None:
        """The prompt's scored batch (its rewards still computing), or None: give the prompt back. ``closing``:
        the server is stopping, so sessions it ended lose samples as expected (logged at DEBUG, not WARNING:
        an endpoint demo's normal end logged 24 warnings)."""
        now = time.monotonic()
        g, env_cfg = self.cfg.rollout.group_size, self.cfg.rollout.env
        kept = env_groups.survivors(item.samples[:g], env_cfg, g, self.env.stats)
        baselines = [item.samples[g]] if self.greedy_baseline else None
        group = f"{self.client_id}/{key}"
        if kept is None and all(env_groups.untaken(s) for s in item.samples[:g]):
            self.env.settled(group, False, "no agent took the group's tasks")  # logged once by the sessions
            return None
        if kept is None or (baselines and env_groups.is_dropped(baselines[0], "score")):
            log.log(
                logging.DEBUG if closing else logging.WARNING,
                "prompt %s lost too many samples (failed environment steps or sessions; group rule: "
                "rollout.env.min_group_samples); it goes back to the broker",
                item.prompt.prompt_id,
            )
            self.env.settled(
                group,
                False,
                "too few of the group's samples survived (failed, abandoned or timed-out "
                "sessions; rollout.env.min_group_samples)",
            )
            return None
        self.env.settled(group, True, "")
        if env_groups.shared_prompt(env_groups.own_prompts(kept, item.prompt_ids)) is None:
            self.env.stats.add(groups_per_sample_prompts=1)  # each sample keeps its own prompt (build_groups)
        samples = [kept]
        if item.trace is not None:
            item.trace.generated(
                item.prompt.prompt_id,
                genai_attributes(self.cfg.model.path, self.params, item.prompt_ids, item.samples, item.version),
            )
        lease = m.PromptLease(
            req_id=item.lease.req_id,
            lease_id=item.lease.lease_id,
            expires_in_s=item.lease.expires_in_s,
            prompts=[item.prompt],
        )
        inputs = reward_inputs(lease.prompts, samples) + reward_inputs(lease.prompts, [baselines] if baselines else [])
        rewards = env_groups.score(self.scorer, inputs, samples[0] + (baselines or []))
        return Batch(
            lease,
            [item.prompt_ids],
            samples,
            item.version,
            now - item.started,
            rewards,
            trace=item.trace,
            baselines=baselines,
        )
