"""The learner side of weight sync: the bucket plan, the filesystem publisher, ranks that only consume,
and a broadcast round nobody joins. Rounds with real receivers are in tests/common/weightsync/test_receiver.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fleetrl.common import weightsync as ws
from fleetrl.common.config.schema import JobConfig, SyncConfig
from fleetrl.common.messages import ParamSpec, WeightsInfo
from fleetrl.common.weightsync.sender.publisher import WeightPublisher

MB = ws.MB


def spec(name: str, shape: list[int], dtype: str = "float32") -> ParamSpec:
    return ParamSpec(name=name, shape=shape, dtype=dtype)


def names(buckets) -> list[list[str]]:
    return [[s.name for s in b] for b in buckets]


def job(tmp_path: Path, **sync) -> JobConfig:
    return JobConfig(sync=SyncConfig(**sync))


def synthetic_params(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes, a scalar and an empty tensor: everything the file format has to carry."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(16, 8, generator=g)),
        ("norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("scale", torch.randn((), generator=g)),
        ("empty", torch.zeros(0, 3)),
        ("steps", torch.randint(0, 100, (5,), generator=g)),
        ("mask", torch.rand(4, generator=g) > 0.5),
    ]


def specs_of(params) -> list[ParamSpec]:
    return [ws.make_spec(n, t.shape, t.dtype) for n, t in params]


# ----------------------------------------------------------------------------------- plan


def test_weightsync_imports_without_torch():
    probe = "import sys, fleetrl.common.weightsync\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plan_buckets_fills_up_to_the_limit_in_order():
    # four float32 tensors of 1 MB each, buckets of 2 MB -> [a, b], [c, d]
    specs = [spec(n, [MB // 4]) for n in "abcd"]
    assert names(ws.plan_buckets(specs, 2 * MB)) == [["a", "b"], ["c", "d"]]
    # 2.5 MB buckets: a + b = 2 MB fits, + c = 3 MB does not
    assert names(ws.plan_buckets(specs, 5 * MB // 2)) == [["a", "b"], ["c", "d"]]
    assert names(ws.plan_buckets(specs, 100 * MB)) == [["a", "b", "c", "d"]]


def test_plan_buckets_splits_on_dtype_changes():
    specs = [spec("a", [4]), spec("b", [4], "bfloat16"), spec("c", [4], "bfloat16"), spec("d", [4])]
    buckets = ws.plan_buckets(specs, MB)
    assert names(buckets) == [["a"], ["b", "c"], ["d"]]
    assert all(len({s.dtype for s in b}) == 1 for b in buckets)


def test_plan_buckets_gives_an_oversized_tensor_its_own_bucket():
    # 16 + 4000 + 16 + 16 bytes, buckets of 100 bytes
    specs = [spec("a", [4]), spec("big", [1000]), spec("c", [4]), spec("d", [4])]
    assert names(ws.plan_buckets(specs, 100)) == [["a"], ["big"], ["c", "d"]]


def test_plan_buckets_edge_cases():
    assert ws.plan_buckets([], MB) == []
    assert names(ws.plan_buckets([spec("empty", [0, 3]), spec("s", [])], 4)) == [["empty", "s"]]  # 0 + 4 bytes
    with pytest.raises(ValueError, match="bucket_mb"):
        ws.plan_buckets([spec("a", [1])], 0)
    with pytest.raises(ValueError, match="complex128"):
        ws.plan_buckets([spec("a", [1], "complex128")], MB)


def test_bucket_layout_and_plan_check():
    layout = ws.bucket_layout([spec("a", [2, 3]), spec("b", []), spec("c", [4])])
    assert (layout.dtype, layout.numel, layout.nbytes) == ("float32", 11, 44)  # 6 + 1 + 4 elements
    assert [(s.name, s.offset, s.numel, s.shape) for s in layout.slots] == [
        ("a", 0, 6, (2, 3)),
        ("b", 6, 1, ()),
        ("c", 7, 4, (4,)),
    ]
    with pytest.raises(ValueError, match="mixes dtypes"):
        ws.bucket_layout([spec("a", [1]), spec("b", [1], "float16")])

    expected = {"a": ((2, 3), "bfloat16"), "b": ((), "float32")}
    assert ws.check_plan([[spec("a", [2, 3])], [spec("b", [])]], expected) is None  # dtype may differ
    assert "does not have" in ws.check_plan([[spec("zz", [1])]], expected)
    assert "shape (3, 2)" in ws.check_plan([[spec("a", [3, 2])]], expected)


def test_versions_to_prune_keeps_the_newest_and_ignores_other_names():
    found = ["v2", "v10", "v9", ".v11.tmp-3", "notes", "v1"]
    assert ws.versions_to_prune(found, 2) == ["v1", "v2"]
    assert ws.versions_to_prune(found, 5) == []


# ----------------------------------------------------------------------------- filesystem


def test_filesystem_publish_writes_then_announces_and_prunes(tmp_path):
    params = synthetic_params()
    cfg = job(tmp_path, transport="filesystem", keep_versions=2)
    pub = WeightPublisher(cfg, tmp_path, 0, specs_of(params))
    seen: list[WeightsInfo] = []

    def announce(info: WeightsInfo) -> None:
        # the files are complete and in place when the announcement goes out
        assert Path(info.path, "model.safetensors").is_file()
        assert not list(Path(info.path).parent.glob(".*tmp*"))
        seen.append(info)

    for version in (1, 2, 3):
        metrics = pub.publish(version, version * 10, iter(synthetic_params(version)), announce, 1)
    assert set(metrics) >= {"timing/sync_s", "sync/mb", "sync/mb_per_s", "sync/receivers"}
    assert metrics["sync/mb"] > 0 and metrics["timing/sync_s"] > 0
    assert [Path(i.path).name for i in seen] == ["v1", "v2", "v3"] and {i.transport for i in seen} == {"filesystem"}
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]

    path = tmp_path / "weights" / "v3" / "model.safetensors"
    loaded = load_file(path)
    for name, tensor in synthetic_params(3):
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "version": "3", "step": "30"}
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700  # owner-only


def test_filesystem_publish_honours_sync_dir_and_replaces_a_republished_version(tmp_path):
    params = synthetic_params()
    pub = WeightPublisher(job(tmp_path, transport="filesystem", dir=str(tmp_path / "w")), tmp_path, 0, specs_of(params))
    pub.publish(4, 0, iter(params), lambda info: None, 0)
    pub.publish(4, 0, iter(synthetic_params(9)), lambda info: None, 0)
    written = load_file(tmp_path / "w" / "v4" / "model.safetensors")
    assert torch.equal(written["embed.weight"], synthetic_params(9)[0][1])


def test_other_ranks_consume_everything_and_send_nothing(tmp_path):
    params = synthetic_params()
    consumed = []

    def gathered():  # stands for ZeRO-3: every item is a collective all ranks must take part in
        for item in params:
            consumed.append(item[0])
            yield item

    for transport in ("filesystem", "gloo"):
        consumed.clear()
        pub = WeightPublisher(job(tmp_path, transport=transport), tmp_path, 1, specs_of(params))
        metrics = pub.publish(1, 1, gathered(), lambda info: pytest.fail("rank 1 announced"), 2)
        assert consumed == [n for n, _ in params]
        assert all(v == 0.0 for v in metrics.values())
        pub.close()
    assert not (tmp_path / "weights").exists()


def test_mismatched_params_raise_after_draining(tmp_path):
    params = synthetic_params()
    pub = WeightPublisher(job(tmp_path, transport="filesystem"), tmp_path, 0, specs_of(params))
    left = iter(list(reversed(params)))
    with pytest.raises(ValueError, match="expected 'embed.weight'"):
        pub.publish(1, 1, left, lambda info: None, 0)
    assert next(left, None) is None  # the rest was still consumed
    assert not (tmp_path / "weights").exists() or not list((tmp_path / "weights").iterdir())  # no partial version
    with pytest.raises(ValueError, match="beyond the 6 specs"):
        pub.publish(2, 1, iter(params + [("extra", torch.zeros(1))]), lambda info: None, 0)


# ------------------------------------------------------------------------------- broadcast


def test_broadcast_round_without_receivers_returns_at_once(tmp_path):
    params = synthetic_params()
    pub = WeightPublisher(job(tmp_path, transport="gloo", bucket_mb=1e-4), tmp_path, 0, specs_of(params))
    seen: list[WeightsInfo] = []
    try:
        for expected in (0, 0):
            t0 = time.monotonic()
            metrics = pub.publish(1, 1, iter(params), seen.append, expected)
            assert time.monotonic() - t0 < 2.0
            assert metrics["sync/receivers"] == 0 and metrics["sync/mb"] == 0
    finally:
        pub.close()
    assert [i.round_id for i in seen] == [1, 2]
    info = seen[0]
    assert info.transport == "gloo" and info.master_addr == "127.0.0.1" and info.master_port > 0
    # 100-byte buckets: embed (512 B) alone, the bf16 norm, then scale + empty (fp32), steps, mask
    assert [[s.name for s in b] for b in info.buckets] == [
        ["embed.weight"],
        ["norm.weight"],
        ["scale", "empty"],
        ["steps"],
        ["mask"],
    ]


def test_the_first_bucket_is_packed_before_the_round_waits_for_its_receivers(tmp_path, monkeypatch):
    """Bucket 0 is copied and digested while the receivers join, not after: a rollout counts a version
    behind from the announcement until the round ends (issue 24)."""
    from fleetrl.common.weightsync.sender.broadcast import BroadcastSender

    params = synthetic_params()
    pub = WeightPublisher(job(tmp_path, transport="gloo", bucket_mb=1e-4), tmp_path, 0, specs_of(params))
    digests_at_close: list[dict[int, str]] = []
    close_round = BroadcastSender._close_round

    def recording(self, store, keys, expected, deadline, sent, **kw):
        digests_at_close.append(dict(self._digests))
        return close_round(self, store, keys, expected, deadline, sent, **kw)

    monkeypatch.setattr(BroadcastSender, "_close_round", recording)
    try:
        pub.publish(1, 1, iter(params), lambda info: None, 0)
    finally:
        pub.close()
    embed = params[0][1].reshape(-1).contiguous().view(torch.uint8).numpy()  # bucket 0 holds embed.weight alone
    assert digests_at_close == [{0: ws.digest(embed)}]
