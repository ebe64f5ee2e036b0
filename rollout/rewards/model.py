"""The ``model`` reward: a local reward model (``AutoModelForSequenceClassification``) scores batches.

The text scored is ``prompt + response`` for a text prompt, or the tokenizer's chat template over
``messages + [{"role": "assistant", "content": response}]`` for a chat prompt. The score is the
logit ``label`` of the sequence's last token (column 0 of a one-label reward model). Batches are
right-padded (positions match an unpadded pass) and truncated from the left (the response's end,
what the reward model judges, is kept). torch and transformers are imported only when configured.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated, Any, Literal

from fleetrl.common.config.base import doc
from fleetrl.rollout.rewards.base import Reward, RewardArgs, RewardArgsError, RewardInput, convert_args, register_reward


@register_reward("model")
class ModelReward(Reward):
    """Scores whole batches with a sequence-classification model; one forward pass at a time."""

    class Args(RewardArgs):
        path: Annotated[str, doc("Local directory of the reward model (saved with save_pretrained).")]
        label: Annotated[int, doc("Which output logit is the score (0 for a one-label reward model).", ge=0)] = 0
        batch_size: Annotated[int, doc("Sequences per forward pass.", ge=1)] = 8
        max_length: Annotated[int, doc("Longest input in tokens; longer ones lose their start.", ge=1)] = 4096
        device: Annotated[str, doc("Torch device of the reward model: cpu, cuda, cuda:1.")] = "cpu"
        dtype: Annotated[Literal["float32", "bfloat16", "float16"], doc("Weight dtype.")] = "float32"
        trust_remote_code: Annotated[bool, doc("Allow custom modelling code shipped in the model directory.")] = False

    @classmethod
    def check(cls, **args: Any) -> None:
        a = convert_args(cls.name, cls.Args, args)
        if not (Path(a.path) / "config.json").is_file():
            raise RewardArgsError(
                f"path {a.path!r} is not a model directory (no config.json); "
                "set it to a local AutoModelForSequenceClassification directory written by save_pretrained"
            )

    def __init__(self, **args: Any):
        super().__init__(**args)
        a = self.args
        self.check(**args)
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification

        from fleetrl.common.chat.tokenizer import load_tokenizer

        config = AutoConfig.from_pretrained(a.path, trust_remote_code=a.trust_remote_code)
        archs = config.architectures or []
        if not any(arch.endswith("ForSequenceClassification") for arch in archs):
            # from_pretrained would attach a randomly initialised head and score noise
            raise RewardArgsError(
                f"{a.path!r} holds a {archs or 'model'} checkpoint, not a sequence-classification one"
            )
        if a.label >= config.num_labels:
            raise RewardArgsError(f"label {a.label} is out of range: the model has {config.num_labels} labels")
        self.torch = torch
        self.tokenizer = load_tokenizer(a.path, a.trust_remote_code)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            a.path, dtype=getattr(torch, a.dtype), trust_remote_code=a.trust_remote_code
        )
        self.model.to(a.device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length = min(a.max_length, getattr(config, "max_position_embeddings", None) or a.max_length)
        self._lock = threading.Lock()  # one forward at a time; tokenizers are not re-entrant either

    def text(self, x: RewardInput) -> str:
        """The string the reward model reads for one sample."""
        if isinstance(x.prompt, str):
            return x.prompt + x.response
        messages = [*x.prompt, {"role": "assistant", "content": x.response}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def __call__(self, batch: list[RewardInput]) -> list[float]:
        scores: list[float] = []
        bs = self.args.batch_size
        with self._lock, self.torch.inference_mode():
            texts = [self.text(x) for x in batch]
            for i in range(0, len(texts), bs):
                enc = self.tokenizer(
                    texts[i : i + bs], return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
                ).to(self.args.device)
                logits = self.model(**enc).logits  # [B, num_labels]
                scores.extend(logits[:, self.args.label].float().tolist())
        return scores

    def close(self) -> None:
        self.model = None
