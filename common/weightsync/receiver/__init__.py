"""The receiving side of weight sync (rollout servers, vLLM workers): ``receiver.py`` (``WeightReceiver``, the
``RECEIVERS`` registry and the filesystem receiver) and ``broadcast.py`` (the gloo/NCCL round, receiver side).
Torch is imported where it is used."""
