"""Data as the ecosystem writes it (common/data/tables.py): files of every format, `save_to_disk` directories,
`datasets.load_dataset` by directory, builder + data_files and split (offline, the real loading path), dotted
nested keys (verl's layout) and the `data.map` hook; bad input is one line naming the key."""

from __future__ import annotations

import csv
import json

import pytest

from fleetrl.common.config import load_config
from fleetrl.common.data.tables import DataError, load_rows

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]


def data_cfg(*overrides: str):
    return load_config(None, list(overrides)).data


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_file_format_reads_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "b.json").write_text(json.dumps({"data": ROWS}))
    with (tmp_path / "a.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "answer"])
        writer.writeheader()
        writer.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    for name in ("a.jsonl", "a.json", "b.json", "a.csv", "a.parquet"):
        assert load_rows(tmp_path / name) == ROWS, name
    with pytest.raises(DataError, match=r"data.eval='.*nope.jsonl' does not exist"):
        load_rows(str(jsonl).replace("a.jsonl", "nope.jsonl"), "data.eval")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_rows(tmp_path / "bad.jsonl")


def test_datasets_directories_and_names_load_offline_by_split(tmp_path):
    import datasets

    train, test = ROWS[:3], ROWS[3:]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(tmp_path / "saved", "data.train", data_cfg()) == train
    assert load_rows(tmp_path / "saved", "data.eval", data_cfg()) == test  # data.eval_split: test
    with pytest.raises(DataError, match=r"DatasetDict without a 'dev' split .*set data.split"):
        load_rows(tmp_path / "saved", "data.train", data_cfg("data.split=dev"))
    datasets.Dataset.from_list(train).save_to_disk(str(tmp_path / "one"))
    assert load_rows(tmp_path / "one", "data.train", data_cfg()) == train
    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "train.jsonl", train)
    write_jsonl(files / "test.jsonl", test)
    assert load_rows(files, "data.train", data_cfg()) == train  # a directory of data files: load_dataset(dir)
    assert load_rows(files, "data.eval", data_cfg()) == test
    builder = data_cfg(f"data.data_files={{train: {files / 'train.jsonl'}, test: {files / 'test.jsonl'}}}")
    assert load_rows("json", "data.train", builder) == train  # load_dataset("json", data_files=..., split=...)
    with pytest.raises(DataError, match=r"data.train='someone/not-cached' is neither a local file or directory"):
        load_rows("someone/not-cached", "data.train", data_cfg())


def test_dotted_keys_read_nested_columns_like_verl_writes_them(tmp_path):
    verl = [
        {
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "data_source": "arith",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(3)
    ]
    path = write_jsonl(tmp_path / "verl.jsonl", verl)
    rows = load_rows(path, "data.train", data_cfg("data.answer_key=reward_model.ground_truth"))
    assert [r["reward_model.ground_truth"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "1"}  # the nested column stays too
    from fleetrl.broker.server.prompts import rows_to_prompts

    prompts = rows_to_prompts(rows, "prompt", "reward_model.ground_truth", "data.train")
    assert [p.answer for p in prompts] == ["1", "2", "3"] and prompts[0].metadata["data_source"] == "arith"
    with pytest.raises(DataError, match=r"rows have no 'reward_model.truth' .*fix the key"):
        load_rows(path, "data.train", data_cfg("data.answer_key=reward_model.truth"))


def test_the_map_hook_rewrites_and_drops_rows(tmp_path):
    hooks = tmp_path / "hooks.py"
    hooks.write_text(
        "def to_prompt(row):\n"
        "    if row['answer'] == '3':\n        return None\n"
        "    return {'prompt': 'Q: ' + row['prompt'], 'answer': row['answer']}\n"
        "def broken(row):\n    return [row]\n"
    )
    path = write_jsonl(tmp_path / "a.jsonl", ROWS)
    rows = load_rows(path, "data.train", data_cfg(f"data.map={hooks}:to_prompt"))
    assert [r["prompt"] for r in rows] == ["Q: 0+1=", "Q: 1+1=", "Q: 3+1=", "Q: 4+1="]
    with pytest.raises(DataError, match=r"data.map='.*:broken' returned list for row 0 of data.train; it must return"):
        load_rows(path, "data.train", data_cfg(f"data.map={hooks}:broken"))
    with pytest.raises(DataError, match=r"data.map: module '.*hooks.py' has no attribute 'nope'"):
        load_rows(path, "data.train", data_cfg(f"data.map={hooks}:nope"))
