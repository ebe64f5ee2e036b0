"""``single_turn``: one prompt, one completion, scored by ``rollout.rewards`` (the behaviour before
environments existed, byte for byte: the same prompt encoding, one engine request per sample)."""

from __future__ import annotations

from typing import Any

from fleetrl.common import messages as m
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.envs.base import Environment, Task
from fleetrl.rollout.loop import check_chat_template, encode_prompt


class SingleTurnEnv(Environment):
    multi_turn = False

    def task(self, prompt: m.Prompt) -> Task:
        data = self.cfg.data
        return Task(
            prompt, encode_prompt(self.tokenizer, prompt.prompt, data.apply_chat_template, data.max_prompt_tokens)
        )

    async def episode(
        self, engine: Any, task: Task, params: SamplingParams, request_id: str, trace: dict[str, str] | None
    ) -> Generation:
        return await engine.generate(Request(task.prompt_ids, params, request_id=request_id, trace=trace))

    def check(self) -> None:
        check_chat_template(
            self.tokenizer, self.cfg.data.apply_chat_template, self.cfg.model.tokenizer or self.cfg.model.path
        )

    def metrics(self) -> dict[str, float]:
        return {}
