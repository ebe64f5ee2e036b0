"""The weights fingerprint: equal for the same weights whatever dtype the engine holds them in, different after
an update, and never compared across different tensor sets (common/weightsync/fingerprint.py)."""

from __future__ import annotations

import torch

from fleetrl.common.weightsync import fingerprint as fp


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(300, 70, generator=g), "b.bias": torch.randn(5, generator=g)}


def _published(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return fp.fingerprints({n: fp.sample(t) for n, t in weights.items()})


def test_an_engine_holding_the_published_weights_matches_in_its_own_dtype():
    learner = _weights()
    published = _published(learner)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        engine = {n: t.to(dtype) for n, t in learner.items()}  # what copy_ into the engine's params does
        held = fp.fingerprint(engine.items())
        assert held is not None and held[0] == str(dtype).removeprefix("torch.")
        assert fp.mismatch([3, *held], published) is None


def test_weights_moved_by_one_small_update_do_not_match():
    learner = _weights()
    published = _published({n: t + 1e-3 * torch.randn_like(t) for n, t in learner.items()})  # the next version
    held = fp.fingerprint({n: t.to(torch.bfloat16) for n, t in learner.items()}.items())  # the engine kept these
    why = fp.mismatch([7, *held], published)
    assert why is not None and "version 7" in why


def test_a_sample_is_a_copy_not_a_view():
    t = torch.zeros(10)
    s = fp.sample(t)
    t.add_(1.0)
    assert float(s.sum()) == 0.0


def test_other_tensors_or_unknown_versions_are_not_compared():
    learner = _weights()
    published = _published(learner)
    other = fp.fingerprint({"qkv_proj.weight": torch.randn(4, 4)}.items())  # an engine that fuses or renames
    assert fp.mismatch([1, *other], published) is None
    held = fp.fingerprint({n: t + 1 for n, t in learner.items()}.items())
    assert fp.mismatch([1, *held], None) is None  # no record of that version
    assert fp.mismatch("garbage", published) is None
    assert fp.fingerprint({"steps": torch.zeros(3, dtype=torch.int64)}.items()) is None
