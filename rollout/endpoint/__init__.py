"""The OpenAI-compatible endpoint of a rollout server and its training sessions (server.py, sessions.py)."""
