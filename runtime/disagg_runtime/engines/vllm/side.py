"""What both worker halves hold (`sending.Sends`, `receiving.Loads`): the KV caches in the
layout's layer order, the layout every transfer is checked against, the lease, and the
per-request stats recorder vLLM collects (connector.py)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from disagg_runtime.engines.vllm.layout import KvLayout
from disagg_runtime.engines.vllm.stats import Recorder


class KvSide:
    def __init__(self, caches: Mapping[str, torch.Tensor], layout: KvLayout, lease_s: float):
        self._caches = [caches[name] for name in layout.layers]
        self.layout = layout
        self.lease_s = lease_s
        self.recorder = Recorder()
