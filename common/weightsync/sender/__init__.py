"""The sending side of weight sync (learner rank 0): ``publisher.py`` (``WeightPublisher``, the ``SENDERS``
registry and the filesystem sender) and ``broadcast.py`` (the gloo/NCCL round, sender side). Torch is imported
where it is used."""
