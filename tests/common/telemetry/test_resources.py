"""Resource metrics (common/telemetry/resources.py): this process's CPU and RSS, GPU figures through NVML only when
NVML sees this process on a GPU (omitted otherwise, never zeros), and the aggregates the learner logs
for the broker and the rollout fleet (broker/client/metrics.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import psutil

from fleetrl.broker.client.metrics import fleet_resources, status_metrics
from fleetrl.broker.server.rates import WireStats
from fleetrl.common import messages as m
from fleetrl.common.telemetry.resources import MB, Nvml, ProcessResources


def test_cpu_and_rss_of_this_process():
    res = ProcessResources("resource/learner", min_interval_s=0.0, nvml=False)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:  # ~0.2 s of CPU on this thread
        pass
    out = res.sample()
    assert set(out) == {"resource/learner/cpu_percent", "resource/learner/rss_mb"}  # no GPU keys without NVML
    assert 10.0 < out["resource/learner/cpu_percent"] <= 100.0 * psutil.cpu_count()
    assert abs(out["resource/learner/rss_mb"] - psutil.Process().memory_info().rss / MB) < 64


def test_samples_closer_than_the_interval_repeat_the_previous_one():
    res = ProcessResources("r", min_interval_s=60.0, nvml=False)
    first = res.sample()
    assert res.sample() == first and res.sample() is not res._values


def test_without_nvml_the_gpu_keys_are_left_out():
    assert Nvml.open() is None  # nvidia-ml-py is not installed on the CPU lane (or no driver answers)
    assert not any("gpu" in k for k in ProcessResources("r", nvml=True).sample())


class FakeNvml:
    """pynvml's calls that Nvml makes, over two GPUs: this process runs on GPU 1 only."""

    def __init__(self, pid: int, fail: bool = False):
        self.pid, self.fail = pid, fail

    def nvmlDeviceGetCount(self):  # noqa: N802 - pynvml's names
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, handle):  # noqa: N802
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        other = SimpleNamespace(pid=self.pid + 1, usedGpuMemory=8 * 1024 * MB)
        return [other] if handle == 0 else [other, SimpleNamespace(pid=self.pid, usedGpuMemory=1536 * MB)]

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802
        return SimpleNamespace(gpu=[90, 37][handle])


def test_gpu_figures_from_a_fake_nvml_are_this_process_s_only():
    """Formatting only (a fake handle); the real NVML path is checked on a GPU machine, not here."""
    nvml = Nvml(FakeNvml(pid=4242), pid=4242)
    assert nvml.sample("resource/rollout") == {
        "resource/rollout/gpu_util_percent": 37.0,
        "resource/rollout/gpu_mem_mb": 1536.0,
    }  # GPU 0 is not ours
    assert Nvml(FakeNvml(pid=7), pid=99).sample("r") == {}  # a process without a GPU context: no keys
    res = ProcessResources("r", min_interval_s=0.0, nvml=Nvml(FakeNvml(pid=1, fail=True), pid=1))
    assert set(res.sample()) == {"r/cpu_percent", "r/rss_mb"}  # a driver error drops the GPU keys of that sample


def test_broker_wire_bytes_and_fleet_resources_reach_the_learner_metrics():
    wire = WireStats()
    wire.received(1000, 100.2)
    wire.sent(300, 100.4)
    wire.sent(200, 101.0)
    stats = wire.stats(101.5)
    assert stats["broker/bytes_in"] == 1000 and stats["broker/bytes_out"] == 500
    assert stats["broker/bytes_in_per_s"] == 100.0 and stats["broker/bytes_out_per_s"] == 50.0  # over the 10 s window
    assert "resource/broker/rss_mb" in stats
    servers = [
        {
            "resource/rollout/cpu_percent": 80.0,
            "resource/rollout/rss_mb": 900.0,
            "weights/load_mb_per_s": 40.0,
            "resource/rollout/gpu_util_percent": 50.0,
            "resource/rollout/gpu_mem_mb": 1000.0,
        },
        {"resource/rollout/cpu_percent": 40.0, "resource/rollout/rss_mb": 1200.0, "weights/load_mb_per_s": 10.0},
    ]
    assert fleet_resources(servers) == {
        "resource/rollout/cpu_percent_max": 80.0,
        "resource/rollout/cpu_percent_mean": 60.0,
        "resource/rollout/rss_mb_max": 1200.0,
        "resource/rollout/gpu_util_percent_mean": 50.0,  # only the GPU server
        "resource/rollout/gpu_mem_mb_max": 1000.0,
        "fleet/weights_load_mb_per_s_min": 10.0,
    }
    assert fleet_resources([{"rollout/tokens_per_s": 1.0}]) == {}
    clients = [m.ClientInfo(client_id=f"r{i}", role="rollout", stats=s) for i, s in enumerate(servers)]
    status = m.Status(
        req_id=0,
        broker_id="b",
        uptime_s=1.0,
        policy_version=0,
        queue_depth=0,
        groups_in_flight=0,
        prompts_leased=0,
        groups_in=0,
        groups_out=0,
        groups_in_per_s=0.0,
        groups_out_per_s=0.0,
        dropped_stale=0,
        duplicates=0,
        clients=clients,
        stats=stats,
    )
    out = status_metrics(m.decode_reply(m.encode(status)))  # through the wire
    assert out["broker/bytes_in_per_s"] == 100.0 and out["resource/rollout/rss_mb_max"] == 1200.0
