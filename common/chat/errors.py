"""The failures an episode can end with, and the chat message type.

They sit beside the chat codec because the codec raises ``TemplateMismatch`` and both floors use it
(the rollout's episodes, the learner's warm start); the environments (``rollout/envs/``) raise
``EnvFailure`` and its other kinds (``EnvTimeout``)."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


class EnvFailure(Exception):
    """The environment could not go on (it raised, or answered something outside the contract).
    The sample is dropped and counted under ``env/<kind>_total``; it is never scored."""

    kind = "errors"


class TemplateMismatch(EnvFailure):
    """The chat template rendered an earlier turn differently once a later one was added, so the
    appended tokens would not continue the sampled ones (see ``codec.check_prefix_stable``)."""

    kind = "template_errors"
