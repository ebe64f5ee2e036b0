"""A rollout-side `WeightReceiver` in a process of its own, driven by a test through two queues.

Commands (``cmd_q``)                       Replies (``out_q``)
  ("version", announcement bytes)            -
  ("stall",)  stall in the next round's      ("stalled", pid) when it stalls
              first bucket (to be killed)
  ("apply", version, timeout_s, ref_dir)     ("applied", version or None, {name: ndarray}, stats, greedy)
  ("stop",)                                  -
At start it replies ("ready", pid). ``greedy`` is None, or (this engine's greedy generations, those of
a fresh `HFEngine` loaded from ``ref_dir``) when the receiver drives an `hf` engine.
"""

from __future__ import annotations

import os
import time

PROMPTS = ["1+2=", "17+25=", "x", "what is 12*13? answer: "]


class CaptureEngine:
    """Holds what it is given, for exact comparison (an engine edge fake)."""

    def __init__(self, specs):
        self.specs = specs
        self.state = {}

    def param_specs(self):
        return list(self.specs)

    def update_weights(self, named):
        self.state = {name: t.detach().clone() for name, t in named}

    def load_weights_from_dir(self, path):
        from safetensors.torch import load_file

        self.state = load_file(os.path.join(path, "model.safetensors"))


def _greedy(engine, ref_dir, tokenizer_dir):
    from fleetrl.common.config.schema import ModelConfig, RolloutConfig
    from fleetrl.rollout.engines import SamplingParams, create_engine

    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ref = create_engine("hf", ModelConfig(path=ref_dir, tokenizer=tokenizer_dir), RolloutConfig(), "cpu", 0)

    def run(e):
        return [[(g.token_ids, g.logprobs) for g in group] for group in e.generate_batch(prompts, params, 1)]

    return run(engine), run(ref)


def run_receiver(cfg, client_id, model_dir, specs, cmd_q, out_q):
    import torch

    from fleetrl.common.messages import decode_announcement
    from fleetrl.common.weightsync.receiver.receiver import WeightReceiver

    torch.set_num_threads(1)
    if model_dir:
        from fleetrl.common.config.schema import ModelConfig
        from fleetrl.rollout.engines import create_engine

        engine = create_engine("hf", ModelConfig(path=model_dir), cfg.rollout, "cpu", 0)
        state = lambda: {n: t.detach().numpy().copy() for n, t in engine.model.named_parameters()}  # noqa: E731
    else:
        engine = CaptureEngine(specs)
        state = lambda: {n: t.numpy().copy() for n, t in engine.state.items()}  # noqa: E731
    receiver = WeightReceiver(cfg, engine.param_specs(), "cpu", client_id)
    out_q.put(("ready", os.getpid()))
    while True:
        cmd = cmd_q.get()
        if cmd[0] == "version":
            ann = decode_announcement(cmd[1])
            receiver.on_version(ann.version, ann.weights)
        elif cmd[0] == "stall":  # in the next round's first bucket: joined and in the group, then silent
            import fleetrl.common.weightsync.receiver.broadcast as rounds

            def stall(*_, **__):
                out_q.put(("stalled", os.getpid()))
                time.sleep(3600)

            rounds.receive_buckets = stall
        elif cmd[0] == "apply":
            _, version, timeout_s, ref_dir = cmd
            deadline = time.monotonic() + timeout_s
            while (receiver.pending_version() or 0) < version and time.monotonic() < deadline:
                time.sleep(0.01)
            applied = receiver.apply(engine)
            greedy = _greedy(engine, ref_dir, model_dir) if ref_dir and applied is not None else None
            out_q.put(("applied", applied, state(), receiver.stats(), greedy))
        elif cmd[0] == "stop":
            receiver.close()
            return
