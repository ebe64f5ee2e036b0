"""Weight sync shared by the learner's publisher and the rollout's receiver (docs/weight_sync.md):
the bucket plan, the round protocol's store keys and the filesystem layout (``plan.py``), and the
process groups of a broadcast (``groups.py``). Imports without torch."""

from fleetrl.common.weightsync.auth import Signer, digest, verify  # noqa: F401
from fleetrl.common.weightsync.groups import (  # noqa: F401
    BucketFailed,
    BucketForged,
    broadcast,
    local_address_towards,
    new_group,
    release_group,
    retire_group,
    wait,
    wait_work,
)
from fleetrl.common.weightsync.plan import (  # noqa: F401
    CLOSED,
    JOIN_WINDOW_S,
    MAX_JOINS,
    MAX_KEY_CHARS,
    MAX_REFORMS,
    MB,
    WEIGHTS_FILE,
    BucketLayout,
    CatchupKeys,
    RoundKeys,
    Slot,
    bucket_layout,
    check_plan,
    dtype_bytes,
    dtype_name,
    make_spec,
    new_secret,
    plan_buckets,
    plan_bytes,
    proof,
    safetensors_header,
    spec_bytes,
    spec_numel,
    tag,
    version_dir,
    versions_to_prune,
)
