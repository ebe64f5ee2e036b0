"""Turns as tokens: the chat template applied turn by turn without ever re-tokenizing an earlier turn.

An episode's context is a token list that only grows::

    initial(messages)           the prompt: the template with the generation prompt, tokenized once
    + sampled tokens            exactly as the engine returned them (mask 1)
    + turn_tail(generation)     what the template writes after the assistant's end-of-turn token that the
                                model did not sample (Qwen's "\\n" after <|im_end|>; all of it when the
                                turn was cut by a budget) (mask 0)
    + observation(conv, new)    the new messages as the template writes them after the conversation so
                                far, up to the next generation prompt (mask 0)

``observation`` renders the conversation twice, without and with the new messages, and tokenizes
only the difference; that is exact when the template is *prefix-stable*: rendering a conversation
and then one more message only appends text. ``check_prefix_stable`` verifies this at start-up on
the environment's kind of conversation and names the first mismatching position where it fails (a
template that drops the reasoning of earlier turns, or changes the system prompt once tools appear).

``encode_conversation`` builds a whole conversation the same way (the SFT warm start uses it, so
the model is trained on exactly the token layout the rollouts produce).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from fleetrl.common.chat.errors import Message, TemplateMismatch

DUMMY = "\x00fleetrl-probe\x00"


class Sampled(Protocol):
    """What ``turn_tail`` reads of a generation (``rollout/engines``' ``Generation`` has both)."""

    finish_reason: str
    token_ids: Sequence[int]


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatCodec:
    """The chat template of ``tokenizer`` (with ``tools`` schemas) as token deltas; see the module docstring."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "a multi-turn environment needs a tokenizer with a chat template (the observations "
                "are written with it); use a model whose tokenizer has one, or rollout.env.type=single_turn"
            )
        self.tokenizer, self.tools = tokenizer, tools or None
        self.closer = self._closer()

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        backend = self._backend
        if backend is not None and backend.truncation is None and backend.padding is None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def _backend(self) -> Any:
        """The fast tokenizer's Rust backend, when calling it gives what ``tokenizer(text)`` gives (no special
        tokens split, no truncation or padding left set on it): the same ids at a third less CPU, skipping
        the wrapper's validation and ``BatchEncoding`` (a call of the endpoint tokenizes twice)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "split_special_tokens", False):
            return None
        return None if getattr(backend, "encode_special_tokens", False) else backend

    def initial(self, messages: Sequence[Message]) -> list[int]:
        """The prompt's tokens: the messages with the generation prompt."""
        return self.encode(self.render(messages, True))

    def _closer(self) -> str:
        """The text the template writes after an assistant message's content (its end of turn)."""
        base = [{"role": "user", "content": "x"}]
        opened = self.render(base, True)
        closed = self.render(base + [{"role": "assistant", "content": DUMMY}], False)
        at = closed.find(DUMMY)
        if not closed.startswith(opened) or at < 0:
            raise TemplateMismatch(
                "the chat template does not write an assistant message after its generation "
                f"prompt (prompt ends {opened[-40:]!r}, the message renders as {closed[-60:]!r})"
            )
        return closed[at + len(DUMMY) :]

    def turn_tail(self, gen: Sampled) -> list[int]:
        """Tokens closing an assistant turn that the model did not sample (mask 0)."""
        if not self.closer:
            return []
        if gen.finish_reason == "stop" and gen.token_ids:
            last = decode(self.tokenizer, [gen.token_ids[-1]])
            if last and self.closer.startswith(last):
                return self.encode(self.closer[len(last) :])
        return self.encode(self.closer)

    def observation(self, conversation: Sequence[Message], new: Sequence[Message]) -> list[int]:
        """Tokens of ``new`` messages after ``conversation`` (which ends with an assistant turn), up to and
        including the next generation prompt."""
        before = self.render(conversation, False)
        after = self.render(list(conversation) + list(new), True)
        if not after.startswith(before):
            raise TemplateMismatch(mismatch_message(self, before, after, len(conversation)))
        return self.encode(after[len(before) :])

    def encode_conversation(self, messages: Sequence[Message]) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, response ids, loss mask) of a whole conversation, built as an episode builds it:
        assistant contents tokenized on their own plus the template's end-of-turn (mask 1), everything
        else as observations (mask 0). The conversation must start with non-assistant messages."""
        first = next((i for i, x in enumerate(messages) if x["role"] == "assistant"), None)
        if first is None or first == 0:
            raise ValueError("a conversation to encode needs a prompt message and at least one assistant turn")
        prompt = self.initial(messages[:first])
        ids: list[int] = []
        mask: list[int] = []
        i = first
        while i < len(messages):
            content = str(messages[i].get("content") or "")
            turn = self.encode(content) + self.encode(self.closer)
            ids += turn
            mask += [1] * len(turn)
            j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
            if j < len(messages):
                obs = self.observation(messages[: i + 1], messages[i + 1 : j])
                ids += obs
                mask += [0] * len(obs)
            i = j
        return prompt, ids, mask


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=...)``, on the fast tokenizer's Rust backend when that is what
    the wrapper gives (it cleans up no tokenization spaces): the same text at ~1/7 of the CPU."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def mismatch_message(codec: ChatCodec, before: str, after: str, n_messages: int) -> str:
    """Where ``after`` stops extending ``before``: the character and token position and both texts there."""
    at = _first_difference(before, after)
    tok_before, tok_after = codec.encode(before), codec.encode(after)
    tok_at = _first_difference(tok_before, tok_after)
    return (
        f"the chat template is not prefix-stable: rendering {n_messages} message(s) and then more changes the "
        f"earlier text at character {at} (token {tok_at}): {before[max(0, at - 30) : at + 30]!r} became "
        f"{after[max(0, at - 30) : at + 30]!r}. Token-in/token-out needs a template that only appends; fix the "
        "template (data / tokenizer), or the environment's messages"
    )


GENERIC_EXAMPLE: list[Message] = [
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": "Let me compute that."},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "It is 408."},
    {"role": "user", "content": "And plus one?"},
    {"role": "assistant", "content": "409"},
]


def check_prefix_stable(codec: ChatCodec, messages: Sequence[Message]) -> None:
    """Raise ``TemplateMismatch`` naming the first mismatching position unless every rendering of the
    conversation's turns extends the previous one: for each assistant turn k, the prompt before it
    (with the generation prompt) is a prefix of the text with it, which is a prefix of the next prompt."""
    chain: list[tuple[int, str]] = []
    for k, msg in enumerate(messages):
        if msg["role"] == "assistant" and k > 0:
            chain.append((k, codec.render(messages[:k], True)))
            chain.append((k + 1, codec.render(messages[: k + 1], False)))
    for (n, before), (_, after) in zip(chain, chain[1:]):
        if not after.startswith(before):
            raise TemplateMismatch(mismatch_message(codec, before, after, n))
