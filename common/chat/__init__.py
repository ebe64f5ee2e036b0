"""Chat turns as tokens, shared by the rollout's episodes and the learner's warm start (lazy transformers)."""
