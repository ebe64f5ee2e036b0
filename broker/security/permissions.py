"""The permission table: which role may send which request. Enforced in one place, :func:`authorize`,
which the broker's state machine calls before any handler (docs/broker.md#permissions).

| request | roles | also |
| --- | --- | --- |
| Register | rollout, learner, operator, monitor | claims its key's role, or `monitor` |
| Heartbeat, GetStatus, GetVersion | every role | |
| LeasePrompts, PushGroup, PushGroups, ReturnPrompts | rollout | ReturnPrompts: only its own leases |
| LeaseBatch, AckBatch, Commit, Rewind, PublishVersion | learner | AckBatch: only its own leases; Commit and Rewind act on its own client id |
| Leave | rollout, learner | acts on its own client id; `done` counts from a learner only |
| Control | operator; learner for its rollback | a learner may `pause` (a hold only it can lift), `resume` (its own hold) and `discard` a closed range of versions it published; never `stop` |

Under CURVE the role is the key's (``auth.Principal``) and the request's ``client_id`` must lie in the
key's namespace; without CURVE the role is the one the client registered with.
"""

from __future__ import annotations

from fleetrl.broker.security.auth import Principal
from fleetrl.common import messages as m

EVERY_ROLE = frozenset({"rollout", "learner", "operator", "monitor"})
ROLLOUT, LEARNER, OPERATOR = frozenset({"rollout"}), frozenset({"learner"}), frozenset({"operator"})

PERMISSIONS: dict[type, frozenset[str]] = {
    m.Register: EVERY_ROLE,
    m.Heartbeat: EVERY_ROLE,
    m.GetStatus: EVERY_ROLE,
    m.GetVersion: EVERY_ROLE,
    m.LeasePrompts: ROLLOUT,
    m.PushGroup: ROLLOUT,
    m.PushGroups: ROLLOUT,
    m.ReturnPrompts: ROLLOUT,
    m.LeaseBatch: LEARNER,
    m.AckBatch: LEARNER,
    m.Commit: LEARNER,
    m.Rewind: LEARNER,
    m.PublishVersion: LEARNER,
    m.Leave: ROLLOUT | LEARNER,
    m.Control: OPERATOR | LEARNER,  # a learner only within its rollback: see learner_control
}
REGISTRATION_FREE = (m.Register, m.GetStatus, m.GetVersion)  # answered without a client record


def authorize(principal: Principal, role: str, req: m.Request, version: int) -> str | None:
    """Why ``principal`` (acting as ``role``) may not send ``req``, or None; ``version`` is the broker's."""
    kind = type(req)
    allowed = PERMISSIONS.get(kind, frozenset())
    if role in allowed and not principal.authenticated and not isinstance(req, m.Control):
        return None  # the common case without CURVE: nothing more to check
    if not principal.owns(req.client_id):
        return (
            f"client_id {req.client_id!r} does not belong to key {principal.identity!r}; a key acts only for "
            f"client ids {principal.identity!r} and {principal.identity!r}-*"
        )
    if isinstance(req, m.Register) and principal.authenticated and req.role not in (principal.role, "monitor"):
        return f"key {principal.identity!r} has role {principal.role}; it cannot register as {req.role}"
    if role not in allowed:
        who = f"{principal.identity} ({role})" if principal.authenticated else f"a {role} client"
        return f"{kind.__name__} needs role {' or '.join(sorted(allowed))}; this is {who}"
    if isinstance(req, m.Control) and role == "learner":
        return learner_control(req, version)
    return None


def learner_control(req: m.Control, version: int) -> str | None:
    """A learner's Control is its rollback: pause/resume its own hold, discard versions it published."""
    if req.action == "stop":
        return "Control(stop) needs role operator; a learner may only pause, resume and discard during a rollback"
    if req.action == "discard" and not (0 <= req.min_version and 0 <= req.max_version <= version):
        return (
            f"a learner may discard only a closed range of versions it published, [min, max] with "
            f"0 <= min and max <= {version} (the current version); got [{req.min_version}, {req.max_version}]"
            " (needs role operator otherwise)"
        )
    return None
