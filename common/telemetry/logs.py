"""One logging set-up for every fleetrl process."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname).1s %(process_name)s %(name)s: %(message)s"


class _ProcessName(logging.Filter):
    def __init__(self, name: str):
        super().__init__()
        self.process_name = name

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_name = self.process_name
        return True


class _Stderr(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment a record is emitted, not the one set up with: a process that
    swaps its stderr later (a test's capture, a redirect) keeps its logs and gets no closed-stream errors."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(process_name: str, level: str = "INFO", log_file: str | Path | None = None) -> None:
    """Log to stderr (and ``log_file`` when given) with the process name in every line."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handlers: list[logging.Handler] = [_Stderr()]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for h in handlers:
        h.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        h.addFilter(_ProcessName(process_name))
        root.addHandler(h)
    root.setLevel(level)
    for noisy in ("urllib3", "filelock", "httpx", "DeepSpeed", "deepspeed", "torch.distributed", "datasets"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
