"""The pipeline's graph and the rules across roles: edges and their tensor references,
colocation groups, ratio locks and rollout groups (`spec.rollout`)."""

from __future__ import annotations

from disagg_core.spec import fields as f
from disagg_core.spec import limits
from disagg_core.spec import model as m
from disagg_core.spec.engines import EDGE_KINDS
from disagg_core.spec.fields import Collector, child
from disagg_core.spec.parse_common import (
    DNS_1035_LABEL,
    dns_label,
    or_default,
)

RATIO_LOCK_KEYS = ("leader", "follower", "leaderShare", "followerShare", "tolerance")
ROLLOUT_KEYS = (
    "maxUnavailable", "maxSkew", "partition", "paused", "stepDeadlineSeconds", "groups",
)  # fmt: skip
MAX_ROLLOUT_STEP_DEADLINE_SECONDS = 86_400


def edge(out: Collector, raw: object, path: str) -> m.Edge:
    e = f.fields(
        out, raw, path, known=("from", "to", "kind", "relay", "tensorRefs"), required=("from", "to")
    )
    if e is None:
        return m.Edge(source="", target="")
    return m.Edge(
        source=f.text(out, e, "from", path) or "",
        target=f.text(out, e, "to", path) or "",
        relay=f.choice(out, e, "relay", path, m.RELAYS),
        tensor_refs=_tensor_refs(out, e, path),
        kind=f.choice(out, e, "kind", path, EDGE_KINDS) or "payload",
    )


def _tensor_refs(out: Collector, e: dict[str, object], path: str) -> tuple[m.TensorRef, ...]:
    refs: list[m.TensorRef] = []
    seen: list[tuple[tuple[m.PathStep, ...], str]] = []
    for item_path, raw in f.items(out, e, "tensorRefs", path):
        t = f.fields(out, raw, item_path, known=("path", "to"), required=("path", "to"))
        if t is None:
            continue
        ref = m.TensorRef(
            path=f.text(out, t, "path", item_path) or "", to=f.text(out, t, "to", item_path) or ""
        )
        if ref.path:
            steps = _payload_path(out, ref.path, child(item_path, "path"), seen)
            if steps is not None:
                seen.append((steps, child(item_path, "path")))
        refs.append(ref)
    return tuple(refs)


def _payload_path(
    out: Collector, path: str, where: str, seen: list[tuple[tuple[m.PathStep, ...], str]]
) -> tuple[m.PathStep, ...] | None:
    try:
        steps = m.parse_payload_path(path)
    except ValueError as error:
        out.add(where, f"malformed payload path: {error} (e.g. 'latents' or 'a.b[0]')")
        return None
    for other, other_where in seen:
        shorter = min(len(steps), len(other))
        if steps[:shorter] == other[:shorter]:
            out.add(where, f"{path!r} overlaps the tensor reference at {other_where}")
            return None
    return steps


def group(out: Collector, raw: object, path: str) -> m.ColocationGroup:
    g = f.fields(out, raw, path, known=("name", "roles"), required=("roles",))
    if g is None:
        return m.ColocationGroup(name="", roles=())
    roles = f.texts(out, g, "roles", path) or ()
    listed = g.get("roles")
    if isinstance(listed, list) and len(listed) < 2:
        out.add(
            child(path, "roles"), f"a colocation group needs at least 2 roles, got {len(roles)}"
        )
    name = dns_label(out, g, "name", path, DNS_1035_LABEL)
    return m.ColocationGroup(name=name or (roles[0] if roles else ""), roles=roles)


def ratio_lock(out: Collector, raw: object, path: str) -> m.RatioLockSpec | None:
    r = f.fields(out, raw, path, known=RATIO_LOCK_KEYS, required=("leader", "follower"))
    if r is None:
        return None
    leader = f.text(out, r, "leader", path)
    follower = f.text(out, r, "follower", path)
    if leader is not None and leader == follower:
        out.add(child(path, "follower"), f"a role cannot be locked to itself ({leader!r})")
    tolerance = f.number(out, r, "tolerance", path)
    if tolerance is not None and not 0 <= tolerance < 1:
        out.add(child(path, "tolerance"), f"must be in [0, 1), got {tolerance}")
    return m.RatioLockSpec(
        leader=leader or "",
        follower=follower or "",
        leader_share=or_default(_share(out, r, "leaderShare", path), 1),
        follower_share=or_default(_share(out, r, "followerShare", path), 1),
        tolerance=or_default(tolerance, 0.0),
    )


def _share(out: Collector, r: dict[str, object], key: str, path: str) -> int | None:
    return f.integer(out, r, key, path, minimum=1, maximum=m.MAX_RATIO_SHARE)


def rollout(out: Collector, raw: object, path: str) -> m.Rollout:
    r = f.fields(out, raw, path, known=ROLLOUT_KEYS) or {}
    default = m.Rollout()
    skew = f.int_or_percent(out, r, "maxSkew", path, minimum=1, max_percent=100)
    deadline = f.integer(out, r, "stepDeadlineSeconds", path, minimum=1)
    if deadline is not None and deadline > MAX_ROLLOUT_STEP_DEADLINE_SECONDS:
        out.add(
            child(path, "stepDeadlineSeconds"),
            f"must be at most {MAX_ROLLOUT_STEP_DEADLINE_SECONDS}, got {deadline}",
        )
        deadline = None
    groups = []
    for group_path, group in f.items(out, r, "groups", path):
        if not isinstance(group, list) or not all(isinstance(x, str) and x for x in group):
            out.add(group_path, "expected a list of role names")
        elif long := [k for k, x in enumerate(group) if len(x) > m.MAX_LABEL_LENGTH]:
            out.add(f"{group_path}[{long[0]}]", f"at most {m.MAX_LABEL_LENGTH} characters")
        elif len(group) < 2:
            out.add(group_path, f"a rollout group needs at least 2 roles, got {len(group)}")
        elif len(group) > (most := limits.MAX_ITEMS["spec.rollout.groups[]"]):
            out.add(group_path, f"at most {most} items, got {len(group)}")
        else:
            groups.append(tuple(group))
    return m.Rollout(
        max_unavailable=or_default(
            f.int_or_percent(out, r, "maxUnavailable", path, minimum=1, max_percent=100),
            default.max_unavailable,
        ),
        max_skew=or_default(skew, default.max_skew),
        partition=or_default(
            f.int_or_percent(out, r, "partition", path, max_percent=100), default.partition
        ),
        paused=or_default(f.boolean(out, r, "paused", path), False),
        step_deadline_seconds=or_default(deadline, default.step_deadline_seconds),
        groups=tuple(groups),
    )
