"""TLS for the emulator: a cluster CA and the API server's certificate, made at test time by
trustme (opt-in: ``EmulatorThread(tls=ServerTls())``).

The certificate names 127.0.0.1, localhost and the in-cluster names of the API server
(``kubernetes.default.svc``, ...); ``issue`` adds addresses later (the test node's bridge
address, known only once the node runs) by loading a new certificate into the same server
context: connections made after that see it.
"""

from __future__ import annotations

import ssl

import trustme

IN_CLUSTER_NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


class ServerTls:
    def __init__(self, *hosts: str) -> None:
        self.ca = trustme.CA(organization_name="disagg test cluster")
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.hosts: list[str] = []
        self.issue("127.0.0.1", "localhost", *IN_CLUSTER_NAMES, *hosts)

    def issue(self, *hosts: str) -> None:
        """Serve a certificate that also names `hosts` (IP addresses or DNS names)."""
        self.hosts += [h for h in hosts if h not in self.hosts]
        self.ca.issue_cert(*self.hosts).configure_cert(self.context)

    @property
    def ca_pem(self) -> bytes:
        return self.ca.cert_pem.bytes()

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this CA only."""
        context = ssl.create_default_context(cadata=self.ca_pem.decode())
        return context
