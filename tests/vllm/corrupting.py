"""A decode-side connector that corrupts every transfer it lands (the negative control of
tests/vllm/test_vllm_pd.py: if outputs stay equal with it, the KV never moved)."""

from __future__ import annotations

from typing import Any

import torch

from disagg_runtime.engines.vllm.connector import DisaggConnector
from disagg_runtime.engines.vllm.receiving import Load


class CorruptingConnector(DisaggConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        loads = self._loads
        assert loads is not None, "the negative control runs on the decode engine"
        land = loads._land
        caches = [kv_caches[name] for name in loads.layout.layers]

        def land_then_corrupt(load: Load, msg: Any) -> bool:
            landed = land(load, msg)
            gen = torch.Generator().manual_seed(0)
            for cache in caches:
                for block in load.block_ids:
                    cache[block].add_(torch.randn(cache[block].shape, generator=gen))
            return landed

        loads._land = land_then_corrupt  # type: ignore[method-assign]
