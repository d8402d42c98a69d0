"""A test node beside the API emulator: pods as sandboxed processes (issue 13).

Modules: `api` (HTTP client), `informer` (watch-fed caches), `controllers` (StatefulSet,
Deployment, Endpoints/EndpointSlices), `network` (bridge, netns, veth), `nsexec` (the
namespace entry script), `sandbox` (pod sandbox and container processes), `volumes`,
`probes`, `kubelet` (pod workers), `dns` (cluster DNS), `node` (`Node`, tying it together).
See README.md in this folder for what is emulated and what is not.
"""

from .network import can_create_namespaces
from .node import Node

__all__ = ["Node", "can_create_namespaces"]
