"""A stand-alone weight receiver process for tests: registers with the broker as a rollout server,
receives announced versions through `WeightReceiver`, and saves the tensors of ``--version`` to a file.

    python tests/learner/receiver_main.py --broker ADDR --config JOB --model DIR --version N --out F
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--broker", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from fleetrl.broker.client.sync import ZmqBrokerClient
    from fleetrl.common.config import load_config
    from fleetrl.common.weightsync.receiver.receiver import WeightReceiver

    torch.set_num_threads(1)
    cfg = load_config(args.config)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    specs = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]

    class Capture:
        state: dict = {}

        def update_weights(self, named):
            Capture.state = {n: t.detach().clone().contiguous() for n, t in named}

    client = ZmqBrokerClient(args.broker, "receiver-0", "rollout", timeout_s=10)
    client.connect()
    client.start_heartbeat(lambda: (0, {}), 0.5)
    sub = client.subscribe()
    receiver = WeightReceiver(cfg, specs, "cpu", "receiver-0")
    print("ready", flush=True)
    deadline = time.monotonic() + args.timeout
    try:
        while time.monotonic() < deadline:
            ann = sub.next(timeout_s=0.5)
            if ann is not None and hasattr(ann, "weights"):
                receiver.on_version(ann.version, ann.weights)
            if receiver.pending_version() is not None and receiver.apply(Capture()) == args.version:
                save_file(Capture.state, args.out)
                return 0
        print("no version", args.version, "within", args.timeout, "s", receiver.stats(), file=sys.stderr)
        return 1
    finally:
        receiver.close()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
