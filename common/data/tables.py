"""Reading a table of rows (prompt sets, preference pairs, eval sets) in the forms the ecosystem writes them.

``load_rows(source, key, data)`` accepts

- a file: ``.jsonl`` (one JSON object a line), ``.json`` (a list of objects, or ``{"data": [...]}``),
  ``.parquet``, ``.csv`` (every value a string);
- a directory written by ``datasets``' ``save_to_disk`` (a Dataset, or a DatasetDict's ``data.split``);
- any other directory, or a name: ``datasets.load_dataset(source, data.subset, split=...,
  data_files=data.data_files)`` — a directory of data files, a builder with files (``json`` + data_files),
  or a hub dataset already in the local HF cache (jobs run offline, ``HF_HUB_OFFLINE=1``).

Then ``data.map`` (``module:function``) is called on every row, and dotted column names
(``reward_model.ground_truth``) are resolved: the value is also put under the dotted name itself, so
every reader finds it with a plain ``row[key]``. ``datasets`` and ``pyarrow`` are imported only for the
forms that need them. Every error is a ``DataError`` naming the setting to change.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Callable

from fleetrl.common.config.base import ConfigError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
DISK_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes


class DataError(ConfigError):
    """A data set cannot be read, or a row is malformed; the message names the data and the key to change."""


def load_rows(source: str | Path, key: str = "data.train", data: Any = None, split: str | None = None) -> list[dict[str, Any]]:
    """Rows of ``source``; ``key`` is the setting that named it (quoted in errors); ``data`` the ``DataConfig``
    (split, subset, data_files, map, the column keys); ``split`` overrides the split chosen for ``key``."""
    split = split or _split_for(key, data)
    rows = _read(str(source), key, data, split)
    hook = getattr(data, "map", None)
    if hook:
        rows = apply_map(rows, hook, key)
    return flatten_keys(rows, _dotted_keys(data), key)


def _split_for(key: str, data: Any) -> str:
    if data is None:
        return "train"
    return data.eval_split if key in ("data.eval", "data.preference_eval", "--data") else data.split


def _read(source: str, key: str, data: Any, split: str) -> list[dict[str, Any]]:
    p = Path(source).expanduser()
    if p.is_file():
        return read_file(p, key)
    if p.is_dir() and any((p / m).is_file() for m in DISK_MARKERS):
        return _from_disk(p, key, split)
    if p.suffix in FILE_SUFFIXES or source.startswith((".", "/", "~")) and not p.is_dir():
        raise DataError(f"{key}={source!r} does not exist; create it (e.g. `fleetrl init-data`) or fix the path")
    return _load_dataset(source, key, data, split)


def read_file(p: Path, key: str) -> list[dict[str, Any]]:
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix == ".csv":
        with p.open(newline="") as f:
            return [dict(row) for row in csv.DictReader(f)]
    if p.suffix == ".json":
        try:
            rows = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}); fix the file or {key}") from None
        if isinstance(rows, dict) and isinstance(rows.get("data"), list):
            rows = rows["data"]
        if not isinstance(rows, list):
            raise DataError(f"{p}: a .json file ({key}) must hold a list of objects (or {{\"data\": [...]}})")
        return rows
    if p.suffix not in ("", ".jsonl", ".txt"):
        raise DataError(f"{key}={str(p)!r}: unknown file type {p.suffix!r}; use .jsonl, .json, .parquet or .csv "
                        "(or a `datasets` directory)")
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}:{n}: not valid JSON ({e.msg}); every line must be one JSON object") from None
    return rows


def _from_disk(p: Path, key: str, split: str) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            setting = "data.eval_split" if key in ("data.eval", "data.preference_eval") else "data.split"
            raise DataError(f"{key}={str(p)!r} is a DatasetDict without a {split!r} split (it has {list(ds)}); "
                            f"set {setting}")
        ds = ds[split]
    return ds.to_list()


def _load_dataset(source: str, key: str, data: Any, split: str) -> list[dict[str, Any]]:
    """``datasets.load_dataset`` as a user would call it; offline, a hub name must already be cached."""
    import datasets

    datasets.disable_progress_bars()
    subset = getattr(data, "subset", None)
    data_files = getattr(data, "data_files", None)
    try:
        ds = datasets.load_dataset(source, subset, split=split, data_files=data_files)
    except ValueError as e:
        text = str(e).splitlines()[0]
        if "split" in text.lower():
            raise DataError(f"{key}={source!r}: {text}; set data.split / data.eval_split") from None
        raise DataError(f"{key}={source!r} could not be loaded by datasets.load_dataset ({text}); check data.subset "
                        "and data.data_files") from None
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; each is a data problem to name
        if not _not_available(e):
            raise DataError(f"{key}={source!r} could not be loaded ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200]}); check the name, data.subset, data.split and "
                            "data.data_files") from None
        raise DataError(f"{key}={source!r} is neither a local file or directory nor a dataset in the local HF cache "
                        f"({str(e).splitlines()[0][:200]}). Jobs run offline: save it first (e.g. "
                        f"`datasets.load_dataset({source!r}).save_to_disk('data/x')`) and set {key}=data/x") from None
    if isinstance(ds, datasets.DatasetDict):  # no split asked for: should not happen, but name it
        raise DataError(f"{key}={source!r} has splits {list(ds)}; set data.split")
    return ds.to_list()


def _not_available(error: BaseException) -> bool:
    """A name that is not on disk (offline, nothing cached) rather than a data set that fails to load."""
    return isinstance(error, (FileNotFoundError, ConnectionError)) or "NotFound" in type(error).__name__ \
        or "OfflineMode" in str(error)


def apply_map(rows: list[dict[str, Any]], ref: str, key: str) -> list[dict[str, Any]]:
    """``data.map`` on every row: the row it returns (a dict), or None to leave the row out."""
    fn = load_hook(ref)
    out = []
    for i, row in enumerate(rows):
        try:
            new = fn(dict(row))
        except Exception as e:  # noqa: BLE001 - user code: name the row and the hook
            raise DataError(f"data.map={ref!r} raised on row {i} of {key} ({type(e).__name__}: {e}); fix the hook "
                            "or the row") from None
        if new is None:
            continue
        if not isinstance(new, dict):
            raise DataError(f"data.map={ref!r} returned {type(new).__name__} for row {i} of {key}; it must return "
                            "a dict (the row to use) or None (leave the row out)")
        out.append(new)
    return out


def load_hook(ref: str) -> Callable[[dict[str, Any]], Any]:
    from fleetrl.common.plugins.userfn import FunctionRefError, load_function

    try:
        return load_function(ref)
    except FunctionRefError as e:
        raise DataError(f"data.map: {e}") from None


def _dotted_keys(data: Any) -> list[str]:
    if data is None:
        return []
    keys = (data.prompt_key, data.answer_key, data.chosen_key, data.rejected_key)
    return [k for k in keys if "." in k]


def get_path(row: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """(found, value) of ``a.b.c`` in nested dicts; a column literally named ``a.b.c`` wins."""
    if dotted in row:
        return True, row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def flatten_keys(rows: list[dict[str, Any]], dotted: list[str], key: str) -> list[dict[str, Any]]:
    """Put the value of every dotted key under that name too (``row["reward_model.ground_truth"]``)."""
    if not dotted:
        return rows
    for name in dotted:
        if rows and not get_path(rows[0], name)[0]:
            top = sorted(rows[0])
            raise DataError(f"{key}: rows have no {name!r} (a dotted key reads nested columns; top-level columns: "
                            f"{top}); fix the key that names it")
    for row in rows:
        for name in dotted:
            found, value = get_path(row, name)
            if found:
                row[name] = value
    return rows


def first_row(p: Path, key: str) -> dict[str, Any] | None:
    """The first row of a local file, cheaply ({} when it has none); None for a directory (that needs loading)."""
    if p.is_dir():
        return None
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(p).read_row_group(0) if pq.ParquetFile(p).num_row_groups else None
        return table.slice(0, 1).to_pylist()[0] if table is not None and table.num_rows else {}
    if p.suffix == ".csv":
        with p.open(newline="") as f:
            return next(csv.DictReader(f), {})
    if p.suffix == ".json":
        rows = read_file(p, key)
        return rows[0] if rows and isinstance(rows[0], dict) else {}
    if p.suffix not in ("", ".jsonl", ".txt"):
        read_file(p, key)  # raises naming the file type
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}:{n}: not valid JSON ({e.msg}); every line must be one JSON object") from None
                if not isinstance(row, dict):
                    raise DataError(f"{p}:{n}: a line of {key} must be a JSON object, not {type(row).__name__}")
                return row
    return {}
