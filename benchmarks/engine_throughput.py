"""Generation throughput of the engines on CPU.

    python benchmarks/engine_throughput.py [--prompts 16] [--n 8] [--max-new-tokens 64] [--repeats 3]
    .venv-vllm/bin/python benchmarks/engine_throughput.py --suite streaming [--engine vllm|hf]

``--suite streaming`` (the vLLM lane's figures, docs/benchmarks.md "Streaming rollouts"): on a
long-tail workload (a fifth of the samples may run to ``--long-tokens``, the rest stop at
``--short-tokens``; the same per-request seeds in both modes, so the same tokens), samples/s of
today's blocking batch (``--batch-prompts`` x ``--n`` requests, wait for all, next batch) against
streaming (the same number kept in flight, a new request the moment one finishes). With the vllm
engine it then measures in-flight weight updates on the tiny32 and small presets: a learner-side
gloo `WeightPublisher` broadcasts into the receiver inside the vLLM worker while requests stream,
and each update's pause (pause -> load -> resume, ms) and bytes through ``collective_rpc`` are
recorded. The CPU time other processes used during each run is recorded (``others_cpu_share``):
figures taken on a busy machine are flagged there.

The default suite (``hf-loop``):

Builds each preset locally (no hub), generates ``prompts x n`` samples of up to ``max-new-tokens``
a few times and reports generated tokens per second (median and best of the timed repeats, after
one warm-up call; on a shared machine "best" is the steadier figure). For comparison it times the alternative the engine does not use: transformers'
``model.generate(output_logits=True)`` with the same batch, plus the log-prob gather afterwards.
Prints a table and writes benchmarks/results/engine_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from fleetrl.common.config.schema import ModelConfig, RolloutConfig
from fleetrl.learner.init_model import init_model
from fleetrl.rollout.engines import SamplingParams, create_engine

RESULTS = Path(__file__).parent / "results" / "engine_throughput.json"


def machine() -> dict:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def timed(runs: dict, repeats: int) -> dict[str, tuple[list[float], list[int]]]:
    """Seconds and generated tokens of each timed call of each run, after one warm-up call each.
    The runs take turns, so that load from other processes on the machine hits them alike."""
    for run in runs.values():
        run()
    times: dict[str, tuple[list[float], list[int]]] = {name: ([], []) for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens = run()
            times[name][0].append(time.perf_counter() - start)
            times[name][1].append(tokens)
    return times


def summary(seconds: list[float], tokens: list[int]) -> dict:
    rates = [t / s for t, s in zip(tokens, seconds)]
    return {
        "tokens_per_s_median": round(statistics.median(rates)),
        "tokens_per_s_best": round(max(rates)),
        "seconds": [round(s, 3) for s in seconds],
        "tokens": tokens,
    }


def engine_run(model_dir: str, prompt_ids: list[list[int]], n: int, max_new: int):
    engine = create_engine("hf", ModelConfig(path=model_dir), RolloutConfig(), "cpu", seed=0)
    params = SamplingParams(max_new_tokens=max_new)

    def run() -> int:
        return sum(len(s.token_ids) for group in engine.generate(prompt_ids, params, n) for s in group)

    return run


def generate_run(model_dir: str, prompt_ids: list[list[int]], n: int, max_new: int, eos: int, pad: int):
    """The alternative: ``model.generate`` on the n-times repeated batch, log-probs from raw logits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids]).repeat_interleave(n, 0)
    mask = (ids != pad).long()

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
                eos_token_id=eos,
            )
            response = out.sequences[:, width:]
            logp = torch.stack(out.logits, 1).float().log_softmax(-1).gather(2, response[..., None])
        del logp
        ended = (response == eos).int()
        lengths = torch.where(ended.any(1), ended.argmax(1) + 1, response.shape[1])
        return int(lengths.sum())

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["hf-loop", "streaming"], default="hf-loop")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="vllm")
    parser.add_argument("--batch-prompts", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=192)
    parser.add_argument("--short-tokens", type=int, default=12)
    parser.add_argument("--long-frac", type=float, default=0.2)
    parser.add_argument("--total-prompts", type=int, default=32)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="streaming: where vLLM runs (cpu, cuda)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--transport", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--learner-device", default="cpu", help="streaming, nccl: the publisher's GPU (cuda:1)")
    parser.add_argument("--skip-long-tail", action="store_true")
    parser.add_argument("--presets", nargs="+", default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.suite == "streaming":
        from streaming_suite import run_streaming_suite  # benchmarks/streaming_suite.py: the vLLM lane's figures

        run_streaming_suite(args, machine())
        return
    args.presets = args.presets or ["tiny", "small"]

    results = {"machine": machine(), "workload": vars(args) | {"out": None}, "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            model_dir = str(init_model(Path(tmp) / preset, preset=preset, seed=0))
            engine = create_engine("hf", ModelConfig(path=model_dir), RolloutConfig(), "cpu", seed=0)
            tok = engine.tokenizer
            texts = [f"{i * 7 % 100}+{i * 13 % 100}=" for i in range(args.prompts)]
            prompt_ids = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
            runs = {
                "engine_own_loop": engine_run(model_dir, prompt_ids, args.n, args.max_new_tokens),
                "hf_generate_baseline": generate_run(
                    model_dir, prompt_ids, args.n, args.max_new_tokens, tok.eos_token_id, tok.pad_token_id
                ),
            }
            results["presets"][preset] = {name: summary(*t) for name, t in timed(runs, args.repeats).items()}

    print(
        f"machine: {results['machine']['cpu']}, {results['machine']['cores_usable']} cores, "
        f"{results['machine']['torch_threads']} torch threads"
    )
    print(f"workload: {args.prompts} prompts x {args.n} samples x <= {args.max_new_tokens} new tokens")
    print(f"{'preset':8} {'approach':22} {'tok/s median':>13} {'tok/s best':>11}")
    for preset, runs in results["presets"].items():
        for name, figures in runs.items():
            print(f"{preset:8} {name:22} {figures['tokens_per_s_median']:>13} {figures['tokens_per_s_best']:>11}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
