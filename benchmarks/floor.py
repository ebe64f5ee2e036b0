"""The floor: what this machine can do on the demo's job with nothing but torch, in one process.

The same model (the demo's warm start), the same sampling (16 prompts x 8 samples, temperature 1, at most
5 new tokens, stop at eos), the same reward (`exact`), the same GRPO update (group-std advantages,
dynamic sampling's flat groups skipped until 16 groups with signal are in hand, token-mean loss,
AdamW lr 2e-4, grad clip 1.0, one optimizer step per batch) — written as one loop the way nanochat's RL
script is: generate a batch with a KV cache, score it, update, repeat. No broker, no sockets, no second
process, no weight sync, all cores to one torch. fleetrl's samples/s divided by this is how much of the
machine the system keeps (issue 24 asks >= 0.8).

    python benchmarks/floor.py [--seconds 180] [--threads N] [--workdir DIR]

``--workdir`` is the one `benchmarks/vs_trl.py` builds (models/demo-warm, data/arith*.jsonl; made there
when missing). Prints and saves benchmarks/results/floor.json: trained samples/s (the figure fleetrl's
`samples/s` means: completions trained on per second), generated samples/s, the step time split, the
held-out accuracy of the end weights (fleetrl's evaluator, outside the clock) and others' CPU share.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import (  # noqa: E402 - after the path is set
    BUSY_SHARE,
    EVAL_N,
    GROUP_SIZE,
    LR,
    MAX_NEW_TOKENS,
    PROMPTS_PER_STEP,
    CpuWatch,
    demo_accuracy,
    prepare,
)


@torch.no_grad()
def generate(model, prompts: list[list[int]], width: int, eos: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``MAX_NEW_TOKENS`` tokens per row at temperature 1 with a KV cache (prompts left-padded
    to ``width``, explicit positions). Returns (ids [B, width + MAX_NEW_TOKENS], response mask
    [B, MAX_NEW_TOKENS]: 1 up to and including eos)."""
    B, P = len(prompts), width
    ids = torch.full((B, P), pad, dtype=torch.long)
    attn = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :], attn[i, P - len(p) :] = torch.tensor(p), 1
    pos = (attn.cumsum(1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    alive = torch.ones(B, dtype=torch.bool)
    tokens, mask = [], []
    next_pos = pos[:, -1:] + 1
    for _ in range(MAX_NEW_TOKENS):
        tok = torch.multinomial(torch.softmax(logits.float(), -1), 1).squeeze(1)
        tok = torch.where(alive, tok, torch.full_like(tok, pad))
        tokens.append(tok)
        mask.append(alive.clone())
        alive &= tok != eos
        if not alive.any():
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long)], 1)
        out = model(
            input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos, past_key_values=cache, use_cache=True
        )
        cache, logits, next_pos = out.past_key_values, out.logits[:, -1], next_pos + 1
    short = MAX_NEW_TOKENS - len(tokens)  # every row stopped early: the same shape for every batch
    resp = torch.nn.functional.pad(torch.stack(tokens, 1), (0, short), value=pad)
    return torch.cat([ids, resp], 1), torch.nn.functional.pad(torch.stack(mask, 1).long(), (0, short))


def grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[G, n] rewards -> (R - mean) / (std + 1e-6) per group (unbiased std, as fleetrl's `grpo`)."""
    return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)


def update(model, opt, ids: torch.Tensor, resp_mask: torch.Tensor, adv: torch.Tensor, pad: int) -> float:
    """One token-mean policy-gradient step on the sampled batch (ratio 1 at the behaviour weights, so PPO's
    clip is inactive and the gradient is the plain one)."""
    T = resp_mask.shape[1]
    attn = torch.ones_like(ids)
    attn[:, : ids.shape[1] - T] = (ids[:, : ids.shape[1] - T] != pad).long()
    pos = (attn.cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -T:, None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    m = resp_mask.float()
    loss = -(ratio * adv[:, None] * m).sum() / m.sum().clamp_min(1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--workdir",
        default=str(ROOT),
        help="where models/demo-warm and data/ are (default: the checkout, as make demo builds them)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "floor.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fleetrl.learner.sft import read_rows

    work = prepare(Path(args.workdir), 0.25)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = AutoModelForCausalLM.from_pretrained(work["warm"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(work["warm"])
    eos, pad = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    train = read_rows(work["train"])
    encoded = [(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"], str(r["answer"]).strip()) for r in train]
    width = max(len(p) for p, _ in encoded)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    watch = CpuWatch()
    t0 = time.monotonic()
    gen_s = upd_s = 0.0
    steps = trained = generated = 0
    reward_sum = 0.0
    while time.monotonic() - t0 < args.seconds:
        kept_ids, kept_mask, kept_adv = [], [], []
        while len(kept_adv) < PROMPTS_PER_STEP:  # dynamic sampling: lease again until 16 groups carry signal
            batch = rng.sample(encoded, PROMPTS_PER_STEP)
            t = time.monotonic()
            model.eval()
            ids, mask = generate(model, [p for p, _ in batch for _ in range(GROUP_SIZE)], width, eos, pad)
            model.train()
            gen_s += time.monotonic() - t
            generated += ids.shape[0]
            texts = tokenizer.batch_decode(ids[:, -mask.shape[1] :] * mask + pad * (1 - mask), skip_special_tokens=True)
            rewards = torch.tensor([float(texts[i].strip() == batch[i // GROUP_SIZE][1]) for i in range(len(texts))])
            rewards = rewards.view(PROMPTS_PER_STEP, GROUP_SIZE)
            reward_sum += rewards.sum().item()
            adv = grpo_advantages(rewards)
            for g in range(PROMPTS_PER_STEP):
                if rewards[g].max() > rewards[g].min() and len(kept_adv) < PROMPTS_PER_STEP:
                    rows = slice(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
                    kept_ids.append(ids[rows]), kept_mask.append(mask[rows]), kept_adv.append(adv[g])
        t = time.monotonic()
        ids, mask = torch.cat(kept_ids), torch.cat(kept_mask)
        update(model, opt, ids, mask, torch.cat(kept_adv), pad)
        upd_s += time.monotonic() - t
        steps += 1
        trained += ids.shape[0]
    wall = time.monotonic() - t0
    cpu = watch.result()
    cpu["own_cpu_s"] = time.process_time()  # one process: its own CPU time (CpuWatch counts children)
    cpu["others_cpu_share"] = max(0.0, cpu["machine_busy_cpu_s"] - cpu["own_cpu_s"]) / (wall * (os.cpu_count() or 1))
    model.eval()
    accuracy = demo_accuracy(model, tokenizer, read_rows(work["eval"])[:EVAL_N])
    result = {
        "what": "bare-torch GRPO loop on the demo job, one process (benchmarks/floor.py)",
        "threads": args.threads,
        "cores": os.cpu_count(),
        "seconds": wall,
        "steps": steps,
        "trained_samples": trained,
        "generated_samples": generated,
        "trained_samples_per_s": trained / wall,
        "generated_samples_per_s": generated / wall,
        "generate_s": gen_s,
        "update_s": upd_s,
        "reward_mean": reward_sum / max(1, generated),
        "end_weights_accuracy": accuracy,
        "cpu": cpu,
        "comparable": cpu["others_cpu_share"] <= BUSY_SHARE,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"floor: {result['trained_samples_per_s']:.0f} trained samples/s ({result['generated_samples_per_s']:.0f} "
        f"generated/s), {steps} steps in {wall:.0f} s on {args.threads} threads; generate {gen_s:.0f} s, update "
        f"{upd_s:.0f} s; end-weights held-out accuracy {100 * accuracy:.1f}%; others' CPU share "
        f"{100 * cpu['others_cpu_share']:.1f}%{'' if result['comparable'] else ' (BUSY: not a comparable figure)'}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
