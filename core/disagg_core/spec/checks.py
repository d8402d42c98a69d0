"""Cross-object checks: names that must be unique or fit, the role graph (graph_checks.py),
colocation groups, engines (engine_checks.py).

These rules relate several parts of a document (an edge and the roles it names, a tensor
reference and what lies downstream of its edge, the roles that share one pod), so they run on
the parsed model after every object has been read. Anything already reported at a path (see
`Collector.flawed`) is skipped, so one mistake yields one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from disagg_core import quantity, relays
from disagg_core.spec import engine_checks, graph_checks, podpolicy
from disagg_core.spec import model as m
from disagg_core.spec.fields import Collector, child


def check(pipeline: m.Pipeline, out: Collector) -> None:
    """Record every cross-object problem of `pipeline` in `out`."""
    roles = _role_index(pipeline, out)
    _check_derived_names(pipeline, out)
    _check_image(pipeline, out)
    _check_pools(pipeline, out)
    _check_batching(pipeline, out)
    links = graph_checks.check(pipeline, roles, out)
    members = _check_colocation(pipeline, roles, out)
    _check_groups_share_pods(pipeline, roles, out)
    _check_cuda_ipc(pipeline, links, members, out)
    _check_ratio_locks(pipeline, roles, out)
    _check_pod_policy(pipeline, out)
    _check_gateway_max_tokens(pipeline, out)
    _check_rollout_groups(pipeline, roles, out)
    engine_checks.check(pipeline, roles, out)


def _check_gateway_max_tokens(pipeline: m.Pipeline, out: Collector) -> None:
    raw = pipeline.annotations.get(m.ANNOTATION_GATEWAY_MAX_TOKENS)
    if raw is not None and not pipeline.gateway_max_tokens:
        path = child("metadata.annotations", m.ANNOTATION_GATEWAY_MAX_TOKENS)
        out.add(path, f"expected a whole number from 1 to {m.MAX_GATEWAY_TOKENS}")


def _check_pod_policy(pipeline: m.Pipeline, out: Collector) -> None:
    """podTemplates that weaken the pods' isolation, unless the pipeline opted in."""
    out.problems += podpolicy.annotation_problems(pipeline)
    if podpolicy.allowed(pipeline):
        return
    for problem in podpolicy.findings(pipeline):
        reason = f"{problem.reason}; refused unless the pipeline is annotated "
        reason += f'{m.ANNOTATION_ALLOW_PRIVILEGED}: "true" (docs/security.md)'
        out.add(problem.path, reason)


def _check_rollout_groups(pipeline: m.Pipeline, roles: dict[str, int], out: Collector) -> None:
    for i, group in enumerate(pipeline.rollout.groups):
        for name in group:
            if name not in roles:
                out.add(f"spec.rollout.groups[{i}]", f"unknown role {name!r}")


def _check_ratio_locks(pipeline: m.Pipeline, roles: dict[str, int], out: Collector) -> None:
    """Known roles; a role follows at most one leader; no role ends up following itself."""
    followed: dict[str, int] = {}
    for i, lock in enumerate(pipeline.ratio_locks):
        path = f"spec.ratioLocks[{i}]"
        for key, name in (("leader", lock.leader), ("follower", lock.follower)):
            if name and name not in roles:
                out.add(f"{path}.{key}", f"unknown role {name!r}")
        if lock.follower in followed:
            out.add(
                f"{path}.follower",
                f"role {lock.follower!r} already follows a leader "
                f"(spec.ratioLocks[{followed[lock.follower]}])",
            )
        followed.setdefault(lock.follower, i)
        group = next((g for g in pipeline.colocation if lock.leader in g.roles), None)
        share = (lock.leader_share, lock.follower_share)
        if group is not None and lock.follower in group.roles and share != (1, 1):
            out.add(
                path,
                f"{lock.leader!r} and {lock.follower!r} share the pods of colocation group "
                f"{group.name!r}, so their replica counts are always equal",
            )
    leader_of = {lock.follower: lock.leader for lock in pipeline.ratio_locks}
    for i, lock in enumerate(pipeline.ratio_locks):
        seen, name = {lock.follower}, lock.leader
        while name in leader_of and name not in seen:
            seen.add(name)
            name = leader_of[name]
        if name in seen and name == lock.follower:
            out.add(f"spec.ratioLocks[{i}]", f"ratio locks form a cycle through {name!r}")


def _role_index(pipeline: m.Pipeline, out: Collector) -> dict[str, int]:
    """Role name -> index of its first declaration; later duplicates are reported."""
    index: dict[str, int] = {}
    for i, role in enumerate(pipeline.roles):
        if not role.name:
            continue
        if role.name in index:
            first = index[role.name]
            out.add(
                f"spec.roles[{i}].name", f"duplicate role {role.name!r} (also spec.roles[{first}])"
            )
        else:
            index[role.name] = i
    return index


def _check_derived_names(pipeline: m.Pipeline, out: Collector) -> None:
    if not pipeline.name or out.flawed("metadata.name"):
        return
    parts = [(f"spec.roles[{i}].name", role.name) for i, role in enumerate(pipeline.roles)]
    parts += [
        (f"spec.colocation[{g}].name", group.name)
        for g, group in enumerate(pipeline.colocation)
        if group.name and group.name not in group.roles  # a default name is a role's name
    ]
    for path, part in parts:
        if part == m.GATEWAY_NAME and pipeline.gateway.enabled and not out.flawed(path):
            out.add(
                path,
                f"{part!r} is taken by the pipeline's gateway (Deployment "
                f"{pipeline.derived_name(part)!r}); rename it or set spec.gateway.enabled: false",
            )
        derived = pipeline.derived_name(part)
        if part and not out.flawed(path) and len(derived) > m.MAX_DERIVED_NAME_LENGTH:
            out.add(
                path,
                f"the derived name {derived!r} has {len(derived)} characters; at most "
                f"{m.MAX_DERIVED_NAME_LENGTH} fit (pipeline name + '-' + this name), so that "
                "StatefulSet pod labels stay within 63",
            )


def _check_image(pipeline: m.Pipeline, out: Collector) -> None:
    if pipeline.image is not None or out.flawed("spec.image"):
        return
    lacking = [  # dict.fromkeys: each name once, duplicates are reported elsewhere
        role.name
        for i, role in enumerate(pipeline.roles)
        if role.name and role.image is None and not out.flawed(f"spec.roles[{i}].image")
    ]
    if lacking:
        out.add(
            "spec.image",
            f"required unless every role sets image (missing for {_names(dict.fromkeys(lacking))})",
        )


def _check_pools(pipeline: m.Pipeline, out: Collector) -> None:
    default = pipeline.transport
    if not out.flawed("spec.transport"):
        _pool_fits(default.pool_size, default.min_block, "spec.transport.poolSize", out)
    for i, role in enumerate(pipeline.roles):
        own = role.transport
        path = f"spec.roles[{i}].transport"
        if (own.pool_size is None and own.min_block is None) or out.flawed(path):
            continue
        overrides = {"poolSize": own.pool_size, "minBlock": own.min_block}
        if any(v is None and out.flawed(f"spec.transport.{k}") for k, v in overrides.items()):
            continue
        size = default.pool_size if own.pool_size is None else own.pool_size
        block = default.min_block if own.min_block is None else own.min_block
        key = "minBlock" if own.pool_size is None else "poolSize"
        _pool_fits(size, block, f"{path}.{key}", out)


def _check_batching(pipeline: m.Pipeline, out: Collector) -> None:
    """A batch gathers requests that workers hold: more than `concurrency` never meet."""
    for i, role in enumerate(pipeline.roles):
        path = f"spec.roles[{i}].batching.maxBatchSize"
        batching = role.batching
        if batching is None or out.flawed(path) or out.flawed(f"spec.roles[{i}].concurrency"):
            continue
        if batching.max_batch_size > role.concurrency:
            out.add(
                path,
                f"{batching.max_batch_size} exceeds concurrency {role.concurrency}: a replica "
                "handles at most `concurrency` requests at once, so larger batches never form "
                "(raise concurrency)",
            )


def _pool_fits(size: int, block: int, path: str, out: Collector) -> None:
    if size < block:
        out.add(
            path,
            f"the pool ({quantity.format_bytes(size)}) is smaller than its minimum block "
            f"({quantity.format_bytes(block)})",
        )


def _check_colocation(
    pipeline: m.Pipeline, roles: dict[str, int], out: Collector
) -> dict[str, int]:
    """Role name -> index of its group; reports unknown, repeated and shared members."""
    members: dict[str, int] = {}
    names: dict[str, int] = {}
    for g, group in enumerate(pipeline.colocation):
        path = f"spec.colocation[{g}]"
        for k, name in enumerate(group.roles):
            where = f"{path}.roles[{k}]"
            if not graph_checks.known(out, roles, name, where):
                continue
            if name not in members:
                members[name] = g
            elif members[name] == g:
                out.add(where, "listed twice in this group")
            else:
                other = members[name]
                out.add(
                    where,
                    f"already in colocation group {pipeline.colocation[other].name!r} "
                    f"(spec.colocation[{other}]); a role belongs to at most one pod",
                )
        _check_group_name(pipeline, g, names, roles, out)
    return members


def _check_group_name(
    pipeline: m.Pipeline, g: int, names: dict[str, int], roles: dict[str, int], out: Collector
) -> None:
    group = pipeline.colocation[g]
    path = f"spec.colocation[{g}].name"
    if not group.name or group.name in group.roles or out.flawed(path):
        return  # a group named after one of its roles cannot clash: roles are in one group
    if group.name in names:
        out.add(
            path, f"duplicate group name {group.name!r} (also spec.colocation[{names[group.name]}])"
        )
        return
    names[group.name] = g
    if group.name in roles and group.name not in group.roles:
        out.add(
            path,
            f"{group.name!r} is the name of a role outside this group; their derived "
            "object names would collide",
        )


def _check_groups_share_pods(pipeline: m.Pipeline, roles: dict[str, int], out: Collector) -> None:
    """Roles in one group run as containers of one pod: one replica count, one autoscaling
    policy, one network namespace (ports must not clash)."""
    for g, group in enumerate(pipeline.colocation):
        known = list(dict.fromkeys(name for name in group.roles if name in roles))
        members = [pipeline.roles[roles[name]] for name in known]
        _check_group_ranks(members, roles, out)
        if len(members) < 2:
            continue
        if len({role.replicas for role in members}) > 1:
            counts = ", ".join(f"{role.name}={role.replicas}" for role in members)
            out.add(
                f"spec.colocation[{g}].roles",
                f"roles in a group share pods, so replicas must match: {counts}",
            )
        if any(role.autoscaling != members[0].autoscaling for role in members):
            out.add(
                f"spec.colocation[{g}].roles",
                "roles in a group share pods, so autoscaling must match",
            )
        _check_shared_ports(members, roles, group.name, out)


def _check_group_ranks(members: Iterable[m.Role], roles: dict[str, int], out: Collector) -> None:
    """A colocation group is one pod sharing one GPU: its roles cannot be rank sets (one GPU
    per rank) nor multi-pod groups."""
    for role in members:
        for key, value in (("ranks", role.ranks), ("nodes", role.nodes)):
            if value > 1:
                out.add(
                    f"spec.roles[{roles[role.name]}].{key}",
                    f"{value}, but role {role.name!r} is in a colocation group (one pod, one "
                    "GPU shared); ranks and nodes above 1 need a role of its own",
                )


def _check_shared_ports(
    members: Iterable[m.Role], roles: dict[str, int], group: str, out: Collector
) -> None:
    owners: dict[object, str] = {}
    for role in members:
        for k, port in enumerate(role.ports):
            base = f"spec.roles[{roles[role.name]}].ports[{k}]"
            keys = (("name", port.name), ("containerPort", (port.container_port, port.protocol)))
            for key, value in keys:
                if value in ("", (0, port.protocol)) or out.flawed(f"{base}.{key}"):
                    continue
                if owners.get(value, role.name) != role.name:
                    out.add(
                        f"{base}.{key}",
                        f"also used by role {owners[value]!r}, which shares the pod "
                        f"(colocation group {group!r})",
                    )
                owners.setdefault(value, role.name)


def _check_cuda_ipc(
    pipeline: m.Pipeline,
    links: Sequence[graph_checks.Link],
    members: dict[str, int],
    out: Collector,
) -> None:
    for link in links:
        edge = pipeline.edges[link.index]
        relay = pipeline.relay_for(edge)
        info = relays.BY_NAME.get(relay)
        if info is None or not info.same_gpu:
            continue
        group = members.get(link.source)
        if group is None or members.get(link.target) != group:
            origin = "" if edge.relay else " (the default from spec.transport.relay)"
            out.add(
                f"spec.edges[{link.index}]" + (".relay" if edge.relay else ""),
                f"relay {relay}{origin} needs {link.source!r} and {link.target!r} in one "
                "colocation group (the same GPU)",
            )


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(name) for name in names)
