"""Request migration: whether a request reported lost is resent whole to a live replica by
its first sender (the client or gateway), or fails. Pure; client.py acts on it.

A role reports a request with one of `MIGRATE_REASONS` (an `error` to its reply endpoint):
- `handed_back`: the role is draining and had not started it (still queued, waiting for
  the other inputs of a join, or for a downstream replica that pairs with it);
- `lost`: a replica the request went to was lost (killed, restarted) and may have held it
  (routing/inflight.py: a sender cannot know whether that replica had passed it on).
A client that notices an entry replica lost reports the same to itself.

    decide(...) -> "move"    resend as a new attempt (a fresh request id; the old one aborted)
                   "fail"    fail it, saying why (the role named)
                   "ignore"  keep waiting: it streamed output already and the lost role is
                             not the one streaming it (it was most likely passed on)

A request moves only while none of its output has reached the client (nothing can be taken
back), at most `max_attempts` times, and only with at least `margin_s` of its deadline
left; one whose payload the client does not keep (written in place: `reserve`, `upload`)
cannot be resent. Handlers are assumed idempotent (every built-in one is): a pipeline
whose handlers are not sets `max_attempts` 0, or a role whose handler is not says so
(`roles[].idempotent: false`), and a request that may have run there is not resent: one
handed back by role R when a role not idempotent may have run it before R (`Topology.
resend_unsafe`), one lost with a replica (it may have run anywhere) in any such pipeline.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from disagg_core.contract.topology import Topology

HANDED_BACK = "handed_back"  # error reason: a draining role gave the request back
LOST = "lost"  # error reason: a replica the request went to was lost, maybe holding it
MIGRATE_REASONS = (HANDED_BACK, LOST)  # the reasons a first sender moves a request on
DEFAULT_ATTEMPTS = 3
MARGIN_S = 0.5

Verdict = Literal["move", "fail", "ignore"]


@dataclass(frozen=True)
class Policy:
    """How often a request may move, and how much of its deadline must be left to."""

    max_attempts: int = DEFAULT_ATTEMPTS
    margin_s: float = MARGIN_S
    not_idempotent: frozenset[str] = frozenset()  # roles a request must not run at twice
    # role -> the roles of `not_idempotent` a request it hands back may have run at
    unsafe_before: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, topology: Topology) -> Policy:
        """The pipeline's policy: `migrationAttempts`, and its roles that are not
        idempotent."""
        return cls(
            max_attempts=topology.migration_attempts,
            not_idempotent=topology.not_idempotent,
            unsafe_before=topology.resend_unsafe(),
        )

    def ran_unsafe(self, reason: str, role: str) -> frozenset[str]:
        """The roles not idempotent that may have run a request reported at `role`."""
        if reason == HANDED_BACK:
            return self.unsafe_before.get(role, frozenset())
        return self.not_idempotent


@dataclass(frozen=True)
class Seen:
    """What of the request reached its client: exit roles that sent results or chunks,
    and those whose streams ended."""

    output_from: frozenset[str] = frozenset()
    ended: frozenset[str] = frozenset()


def decide(
    policy: Policy,
    *,
    reason: str,
    role: str,
    exits: Collection[str],
    seen: Seen,
    moved: int,
    remaining_s: float,
    kept: bool,
) -> tuple[Verdict, str]:
    """The verdict on a request reported lost at `role` for `reason`, and why (see the
    module docstring). `moved`: how often it moved already; `kept`: its payload is kept."""
    what = (
        f"role {role} handed it back (draining)"
        if reason == HANDED_BACK
        else f"role {role} lost it"
    )
    streaming = role in exits and role in seen.output_from and role not in seen.ended
    if seen.output_from and reason == LOST and not streaming:
        return "ignore", f"output of it came already; role {role} had most likely passed it on"
    if seen.output_from:
        return "fail", f"{what} after output of it had reached the client: it is not moved"
    if policy.max_attempts <= 0:  # (nor is its payload kept: said before `kept`)
        return "fail", f"{what}, and request migration is off (migrationAttempts 0)"
    if not kept:
        return "fail", f"{what}, and its payload was written in place: it cannot be resent"
    if moved >= policy.max_attempts:
        return "fail", f"{what}, and it was moved {moved} times already"
    unsafe = policy.ran_unsafe(reason, role)
    if unsafe:
        names = ", ".join(sorted(unsafe))
        return "fail", f"{what}, and it may have run at {names} (not idempotent): it is not moved"
    if remaining_s < policy.margin_s:
        return "fail", f"{what} with {remaining_s:.2f} s of its deadline left"
    return "move", f"{what}: moved to a live replica"
