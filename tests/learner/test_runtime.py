"""The LR schedule counts learner steps, whatever the number of optimizer steps each one takes."""

from __future__ import annotations

import logging
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from fleetrl.common.config import load_config
from fleetrl.common.net import free_port
from fleetrl.learner.lifecycle import GracefulStop
from fleetrl.learner.runtime import BudgetClock, lr_lambda


def schedule(*overrides: str) -> list[float]:
    cfg = load_config(
        None,
        [
            "learner.total_steps=10",
            "learner.warmup_steps=2",
            "learner.lr_schedule=linear",
            "learner.min_lr_ratio=0.0",
            *overrides,
        ],
    )
    per = cfg.algorithm.optimizer_steps(cfg.learner)
    factor = lr_lambda(cfg)
    return [factor(step * per) for step in range(11)]  # the multiplier at the start of each learner step


def test_warmup_then_linear_decay_to_zero_at_total_steps():
    lrs = schedule()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[6] == pytest.approx(0.5) and lrs[10] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "overrides", [["learner.ppo_epochs=2", "learner.mini_batches=4"], ["algorithm.type=dpo", "learner.ppo_epochs=3"]]
)
def test_several_optimizer_steps_per_learner_step_keep_the_same_schedule(overrides):
    assert schedule(*overrides) == pytest.approx(schedule())


def test_optimizer_steps_inside_one_learner_step_share_its_lr():
    cfg = load_config(
        None,
        [
            "learner.total_steps=10",
            "learner.lr_schedule=linear",
            "learner.ppo_epochs=2",
            "learner.mini_batches=2",
            "learner.min_lr_ratio=0.0",
        ],
    )
    factor = lr_lambda(cfg)
    assert factor(4) == factor(5) == factor(7) == pytest.approx(0.9) and factor(8) == pytest.approx(0.8)


def test_optimizer_steps_per_learner_step():
    assert (
        load_config(None, ["learner.ppo_epochs=2", "learner.mini_batches=4"]).algorithm.optimizer_steps(
            load_config(None, ["learner.ppo_epochs=2", "learner.mini_batches=4"]).learner
        )
        == 8
    )
    dpo = load_config(None, ["algorithm.type=dpo", "learner.ppo_epochs=3"])
    assert dpo.algorithm.optimizer_steps(dpo.learner) == 1


# ------------------------------------------------------------------ learner.lr_decay_by: time (a time budget)


def timed(*overrides: str):
    cfg = load_config(
        None,
        [
            "learner.total_steps=1000",
            "learner.max_minutes=5",
            "learner.lr_decay_by=time",
            "learner.lr_schedule=linear",
            *overrides,
        ],
    )
    clock = BudgetClock(cfg.learner.max_minutes)
    return lr_lambda(cfg, clock), clock


def test_decay_by_time_follows_the_share_of_max_minutes_used():
    factor, clock = timed()
    assert factor(10) == 1.0  # before the clock moves: the peak, whatever the steps
    clock.fraction = 0.5
    assert factor(10) == pytest.approx(0.5)
    clock.fraction = 1.0
    assert factor(10) == pytest.approx(0.0)


def test_decay_by_time_ignores_the_steps_a_run_that_reaches_total_steps_first_stops_mid_schedule():
    factor, clock = timed()
    clock.fraction = 0.1
    assert factor(999) == pytest.approx(0.9)


def test_decay_by_time_keeps_warmup_in_steps_and_the_floor_and_cosine():
    factor, clock = timed("learner.warmup_steps=4", "learner.lr_schedule=cosine", "learner.min_lr_ratio=0.1")
    clock.fraction = 0.5
    assert factor(1) == pytest.approx(0.5)  # warming up: the clock does not count yet
    assert factor(4) == pytest.approx(0.1 + 0.9 * 0.5)  # cos(pi/2): half way between the peak and the floor


def test_decay_by_steps_ignores_the_clock():
    cfg = load_config(None, ["learner.total_steps=100", "learner.max_minutes=5", "learner.lr_schedule=linear"])
    clock = BudgetClock(5)
    clock.fraction = 0.9
    assert lr_lambda(cfg, clock)(50) == pytest.approx(0.5)


def test_decay_by_time_without_max_minutes_stays_at_the_peak_and_says_so(caplog):
    cfg = load_config(None, ["learner.lr_decay_by=time", "learner.lr_schedule=linear", "learner.total_steps=10"])
    clock = BudgetClock(cfg.learner.max_minutes)
    clock.start()
    with caplog.at_level(logging.WARNING, logger="fleetrl.learner.runtime"):
        factor = lr_lambda(cfg, clock)
    assert clock.local_fraction() == 0.0 and factor(9) == 1.0
    assert "learner.lr_decay_by=time" in caplog.text and "learner.max_minutes" in caplog.text


@pytest.fixture
def keep_signal_handlers():
    """GracefulStop installs SIGTERM/SIGINT handlers: give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_the_clock_counts_from_its_start_and_the_stop_agrees_when_it_is_spent(monkeypatch, keep_signal_handlers):
    clock = BudgetClock(1.0)  # 60 s
    assert clock.local_fraction() == 0.0  # not started
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    clock.start()
    stop = GracefulStop()
    now[0] += 30
    assert not stop.agreed(torch.device("cpu"), clock) and clock.fraction == pytest.approx(0.5)
    now[0] += 31
    assert stop.agreed(torch.device("cpu"), clock) and clock.fraction == 1.0
    assert not GracefulStop().agreed(torch.device("cpu"))  # no clock, no signal: go on
    assert BudgetClock(None).local_fraction() == 0.0


def _agree_rank(rank: int, port: int, started_ago: float, out) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    clock = BudgetClock(1.0)
    clock.start()
    clock.started -= started_ago  # this rank started earlier: it has used more of the budget
    stop = GracefulStop()
    stop.requested = rank == 1
    spent = stop.agreed(torch.device("cpu"), clock)
    out.put((rank, spent, clock.fraction))
    tdist.destroy_process_group()


def test_ranks_agree_on_the_largest_share_of_the_budget_and_on_a_signal():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_agree_rank, args=(r, port, 30.0 * (1 - r), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [spent for _, spent, _ in got] == [True, True]  # rank 1's signal stops both
    fractions = [f for _, _, f in got]
    assert fractions[0] == fractions[1] and fractions[0] >= 0.5  # both take rank 0's (30 s of 60 used)
