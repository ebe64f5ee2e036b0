"""The endpoint on a tiny local model for the verifiers trial (run.sh). Run with the project's venv.

    python scripts/verifiers_trial/serve.py OUT_JSON [--session] [key=value ...]

Plain: inference only, writes {"base_url"} to OUT_JSON and serves until killed. ``--session``: a training
server (rollout.env.type=openai) with one task waiting for an agent; writes {"root"} and, when that
session is closed, prints its episode (turns, tokens, loss-mask ones, reward) and exits.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

from fleetrl.common import messages as m
from fleetrl.common.config import load_config
from fleetrl.learner.init_model import init_model
from fleetrl.rollout.endpoint.server import Endpoint
from fleetrl.rollout.engines import SamplingParams, create_engine
from fleetrl.rollout.envs import create_env
from fleetrl.rollout.envs.base import Task


def main() -> int:
    out, session = Path(sys.argv[1]), "--session" in sys.argv
    overrides = [a for a in sys.argv[2:] if a != "--session"]
    model = init_model(Path(tempfile.mkdtemp()) / "small", preset="small")
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            "rollout.openai.enabled=true",
            "rollout.openai.port=0",
            "rollout.max_new_tokens=16",
            "rollout.device=cpu",
            "rollout.openai.session_timeout_s=300",
            *(["rollout.env.type=openai"] if session else []),
            *overrides,
        ],
    )
    engine = create_engine("hf", cfg.model, cfg.rollout, "cpu", 0, num_threads=1)
    env = create_env(cfg, engine.tokenizer)
    ep = Endpoint(cfg, engine, env)
    ep.start()
    out.write_text(json.dumps({"base_url": ep.base_url, "root": ep.root}))
    try:
        if not session:
            while True:
                time.sleep(5)
                print(json.dumps(ep.metrics()), flush=True)
        params = SamplingParams.from_config(cfg.rollout)
        episode = engine.loop.submit(
            env.sessions.offer(Task(m.Prompt("vf:0", "12*34=")), params, "vf/0/0", engine)
        ).result(600)
        print(
            json.dumps(
                {
                    "failed": episode.failed,
                    "error": episode.error,
                    "reward": episode.reward,
                    "turns": episode.turns,
                    "prompt_tokens": len(episode.prompt_ids),
                    "tokens": len(episode.token_ids),
                    "mask_ones": int(sum(episode.loss_mask)),
                }
            ),
            flush=True,
        )
    finally:
        ep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
