"""Checks of the role graph: the edges and the roles they name, cycles, the entry role,
compat tokens across an edge, and where tensor references may point.

A reference to a role that does not exist is reported once, with the closest name
(`known`); an edge that is a self-loop or a duplicate is reported and left out of the
graph (`Link`s are the usable edges), so a later check never reports it again. Tensor
references are checked only on an acyclic graph ("downstream" needs one).
"""

from __future__ import annotations

import difflib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from disagg_core import compat
from disagg_core.spec import model as m
from disagg_core.spec.fields import Collector


@dataclass(frozen=True)
class Link:
    """A usable edge: both roles known, not a self-loop, not a duplicate."""

    index: int
    source: str
    target: str


def check(pipeline: m.Pipeline, roles: dict[str, int], out: Collector) -> list[Link]:
    """Record every problem of the role graph in `out`; the usable edges."""
    links = _links(pipeline, roles, out)
    acyclic = _check_cycles(roles, links, out)
    _check_entry(roles, links, out)
    _check_compat(pipeline, roles, links, out)
    if acyclic:
        _check_tensor_refs(pipeline, roles, links, out)
    return links


def _links(pipeline: m.Pipeline, roles: dict[str, int], out: Collector) -> list[Link]:
    links: list[Link] = []
    seen: dict[tuple[str, str], int] = {}
    for j, edge in enumerate(pipeline.edges):
        source_known = known(out, roles, edge.source, f"spec.edges[{j}].from")
        if not (known(out, roles, edge.target, f"spec.edges[{j}].to") and source_known):
            continue
        if edge.source == edge.target:
            out.add(f"spec.edges[{j}]", f"an edge from {edge.source!r} to itself (a self-loop)")
        elif (edge.source, edge.target) in seen:
            first = seen[edge.source, edge.target]
            out.add(
                f"spec.edges[{j}]",
                f"duplicate edge {edge.source} -> {edge.target} (also spec.edges[{first}])",
            )
        else:
            seen[edge.source, edge.target] = j
            links.append(Link(j, edge.source, edge.target))
    return links


def known(out: Collector, roles: dict[str, int], name: str, path: str) -> bool:
    """Whether `name` is a declared role; reports it at `path` when it is not."""
    if not name:
        return False
    if name not in roles:
        close = difflib.get_close_matches(name, sorted(roles), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        out.add(path, f"unknown role {name!r}{hint}")
        return False
    return True


def _downstream(links: Sequence[Link]) -> dict[str, list[Link]]:
    result: dict[str, list[Link]] = {}
    for link in links:
        result.setdefault(link.source, []).append(link)
    return result


def _reachable(start: str, adjacency: dict[str, list[Link]]) -> set[str]:
    seen: set[str] = set()
    frontier = [link.target for link in adjacency.get(start, [])]
    while frontier:
        current = frontier.pop()
        if current not in seen:
            seen.add(current)
            frontier.extend(link.target for link in adjacency.get(current, []))
    return seen


def _check_cycles(roles: dict[str, int], links: Sequence[Link], out: Collector) -> bool:
    """Report one cycle per strongly connected part of the graph; True when there is none."""
    adjacency = _downstream(links)
    reach = {name: _reachable(name, adjacency) for name in roles}
    covered: set[str] = set()
    for name in roles:
        if name in covered or name not in reach[name]:
            continue
        covered |= {other for other in reach[name] if name in reach[other]}
        cycle = _shortest_cycle(name, adjacency)
        path = " -> ".join([name, *(link.target for link in cycle)])
        out.add(f"spec.edges[{cycle[-1].index}]", f"closes a cycle: {path}")
    return not covered


def _shortest_cycle(start: str, adjacency: dict[str, list[Link]]) -> list[Link]:
    """The links of a shortest cycle through `start` (which must lie on one)."""
    came_by: dict[str, Link] = {}
    queue = deque([start])
    while queue:
        current = queue.popleft()
        for link in adjacency.get(current, []):
            if link.target == start:
                cycle = [link]
                while cycle[0].source != start:
                    cycle.insert(0, came_by[cycle[0].source])
                return cycle
            if link.target not in came_by:
                came_by[link.target] = link
                queue.append(link.target)
    raise AssertionError(f"{start!r} lies on no cycle")


def _check_entry(roles: dict[str, int], links: Sequence[Link], out: Collector) -> None:
    targets = {link.target for link in links}
    if roles and all(name in targets for name in roles):
        out.add(
            "spec.edges", "no entry role: every role has an incoming edge, so none takes requests"
        )


def _check_compat(
    pipeline: m.Pipeline, roles: dict[str, int], links: Sequence[Link], out: Collector
) -> None:
    """Two neighbouring roles that both declare a compat token must pair (disagg_core.compat),
    else no request could cross their edge."""
    pairs = {(link.source, link.target) for link in links}
    pairs |= {
        (link.source, ref.to)
        for link in links
        for ref in pipeline.edges[link.index].tensor_refs
        if ref.to in roles
    }
    for source, target in sorted(pairs):
        a, b = (pipeline.roles[roles[name]] for name in (source, target))
        if a.compat is None or b.compat is None:
            continue
        mine = compat.Compat(a.compat, frozenset(a.compatible_with))
        theirs = compat.Compat(b.compat, frozenset(b.compatible_with))
        if not compat.compatible(mine, theirs):
            out.add(
                f"spec.roles[{roles[target]}].compat",
                f"{b.compat!r} does not pair with {a.compat!r} of role {source!r}, which sends "
                "to it: give both the same token or list one in the other's compatibleWith",
            )


def _check_tensor_refs(
    pipeline: m.Pipeline, roles: dict[str, int], links: Sequence[Link], out: Collector
) -> None:
    adjacency = _downstream(links)
    for link in links:
        later = _reachable(link.target, adjacency)
        for k, ref in enumerate(pipeline.edges[link.index].tensor_refs):
            path = f"spec.edges[{link.index}].tensorRefs[{k}].to"
            if out.flawed(path) or not known(out, roles, ref.to, path):
                continue
            if ref.to == link.target:
                out.add(path, f"{ref.to!r} is this edge's target: send the tensor in the payload")
            elif ref.to not in later:
                out.add(
                    path,
                    f"role {ref.to!r} is not downstream of {link.target!r}; a tensor reference "
                    "skips ahead to a role after the edge's target",
                )
