"""Cluster DNS for the node's pods, on dnslib: UDP and TCP on the bridge address, port 53
(pods' resolv.conf names it). It answers from the node's informer caches, as CoreDNS's
kubernetes plugin answers from EndpointSlices:

    <svc>.<ns>.svc.cluster.local          A: the ready endpoints of the Service's slices
                                          (publishNotReadyAddresses: every endpoint; the
                                          controller marks them ready). A Service that is
                                          not headless gets the same answer: the node has
                                          no kube-proxy, so there are no cluster IPs.
    <host>.<svc>.<ns>.svc.cluster.local   A: the endpoint whose hostname is <host>
    anything else                         NXDOMAIN (nothing is forwarded off the node)

TTL 5 s, as CoreDNS's default for cluster names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSServer

from .informer import Informer

TTL = 5
Obj = dict[str, Any]


class ClusterResolver(BaseResolver):  # type: ignore[misc]
    def __init__(
        self,
        services: Informer,
        slices: Informer,
        domain: str = "cluster.local",
        static: dict[str, list[str]] | None = None,
    ):
        """`static`: names answered as given (the `kubernetes` Service, which has no
        EndpointSlice of pods here)."""
        self.services = services
        self.slices = slices
        self.suffix = f".svc.{domain}"
        self.static = dict(static or {})

    def addresses(self, name: str) -> list[str] | None:
        """IPs for `name` (no trailing dot); None when the name does not exist."""
        if name in self.static:
            return self.static[name]
        if not name.endswith(self.suffix):
            return None
        labels = name[: -len(self.suffix)].split(".")
        if len(labels) not in (2, 3):
            return None
        host = labels[0] if len(labels) == 3 else None
        svc, ns = labels[-2], labels[-1]
        if self.services.get(ns, svc) is None:
            return None
        ips: list[str] = []
        for sl in list(self.slices.cache.values()):
            meta = sl.get("metadata") or {}
            if meta.get("namespace") != ns:
                continue
            if (meta.get("labels") or {}).get("kubernetes.io/service-name") != svc:
                continue
            for ep in sl.get("endpoints") or []:
                if not (ep.get("conditions") or {}).get("ready"):
                    continue
                if host is not None and ep.get("hostname") != host:
                    continue
                ips.extend(str(a) for a in ep.get("addresses") or [])
        if host is not None and not ips:
            return None
        return sorted(set(ips))

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".").lower()
        ips = self.addresses(qname)
        if ips is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        if request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for ip in ips:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=TTL))
        return reply


class _QuietLogger:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class ClusterDns:
    def __init__(self, resolver: ClusterResolver, address: str, port: int = 53) -> None:
        logger = _QuietLogger()
        self.servers = [
            DNSServer(resolver, address=address, port=port, logger=logger),
            DNSServer(resolver, address=address, port=port, tcp=True, logger=logger),
        ]

    def start(self) -> None:
        for server in self.servers:
            server.start_thread()

    def stop(self) -> None:
        for server in self.servers:
            server.server.shutdown()
            server.server.server_close()
