"""Reading a table of rows (prompt sets, preference pairs, eval sets) from the formats users keep them in.

.jsonl (one JSON object a line), .json (a list of objects), .parquet, or a directory saved by HF
``datasets`` (``save_to_disk``; a DatasetDict's ``train`` split). ``datasets`` and ``pyarrow`` are
imported only for the formats that need them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A data file cannot be read; the message names the file and the key to change."""


def load_rows(path: str | Path, key: str = "data.train") -> list[dict[str, Any]]:
    """Rows of ``path``; ``key`` is the setting that named it, quoted in errors."""
    p = Path(path)
    if p.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{key}={str(path)!r} is a DatasetDict without a `train` split: {list(ds)}")
            ds = ds["train"]
        return [dict(row) for row in ds]
    if not p.is_file():
        raise DataError(f"{key}={str(path)!r} does not exist; create it (e.g. `fleetrl init-data`) or fix the path")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix == ".json":
        rows = json.loads(p.read_text())
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json file ({key}) must hold a list of objects")
        return rows
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); every line must be one JSON object") from None
    return rows
