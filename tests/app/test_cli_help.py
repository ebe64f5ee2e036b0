"""What `--help` claims is true: the file types `eval --data` reads, the small preset's size."""

from __future__ import annotations

import csv
import re
import subprocess
import sys

from fleetrl.common.data.tables import load_rows


def _help(*command: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "fleetrl.app.cli", *command, "--help"], capture_output=True, text=True, check=True
    )
    return " ".join(out.stdout.split())  # argparse wraps lines


def test_eval_help_names_csv_and_csv_loads(tmp_path):
    assert ".jsonl/.json/.parquet/.csv" in _help("eval")
    path = tmp_path / "eval.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([["prompt", "answer"], ["1+2=", "3"]])
    assert load_rows(path, "--data") == [{"prompt": "1+2=", "answer": "3"}]


def test_init_model_help_says_the_small_presets_size():
    from fleetrl.learner.init_model import build_model, build_tokenizer

    said = float(re.search(r"small: ~([\d.]+)M", _help("init-model")).group(1))
    size = sum(p.numel() for p in build_model(build_tokenizer(), "small", 0, 512).parameters())
    assert round(size / 1e6, 2) == said, size
