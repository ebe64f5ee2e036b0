"""Commands that hand one component's code to another: the application is the only floor that sees both.

The learner measures held-out accuracy with the rollout's evaluator (``rollout/eval.py``'s
``evaluate_model``: the engine, environments and rewards `fleetrl eval` uses). Learner and rollout are
peers that never import each other, so the learner takes the evaluator as an argument
(``learner/evaluate.py``'s ``EvaluateModel``) and these entries pass it in. The rollout package is
imported only when an evaluation runs, as before.
"""

from __future__ import annotations

from typing import Any


def evaluate_model(*args: Any, **kwargs: Any) -> dict[str, float]:
    """``rollout/eval.py``'s ``evaluate_model``, imported when first called."""
    from fleetrl.rollout.eval import evaluate_model as run

    return run(*args, **kwargs)


def learner(args: Any) -> int:
    """`fleetrl learner`: one learner rank, with the rollout's evaluator for ``run.eval_interval``."""
    from fleetrl.learner.train import main

    return main(args, evaluate_model=evaluate_model)


def sft(args: Any) -> int:
    """`fleetrl sft`: the supervised warm start, stopped early by the rollout's evaluator."""
    from fleetrl.learner.sft import main

    return main(args, evaluate_model=evaluate_model)
