"""The one tokenizer loader: a job's tokenizer (``model.tokenizer``, else ``model.path``) or a model directory's,
always honouring ``trust_remote_code``. Transformers is imported when a tokenizer is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetrl.common.config.schema import ModelConfig


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained`` of a local directory (jobs run offline; ``preflight.py`` checks it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def job_tokenizer(model: ModelConfig) -> Any:
    """The tokenizer a job's ``model`` section names: ``model.tokenizer`` or ``model.path``'s own."""
    return load_tokenizer(model.tokenizer or model.path, model.trust_remote_code)
