"""Tensor parallel for the Hugging Face LLM roles (hf_llm.py) on a replica of several ranks.

transformers shards the model itself: `from_pretrained(distributed_config=
DistributedConfig(tp_plan="auto"))` applies the model's own `base_model_tp_plan` (attention
projections column/row-wise, one all-reduce after each block) over the world the role's
ranks form (role/ranks.py: gloo on CPU, NCCL on GPU). Its CPU path works with gloo: the
same greedy tokens as one process (tests/integration/test_ranked_models.py).

What crosses roles stays whole: a rank holds `kv_heads / world` of each layer's key/value
heads, contiguous and in rank order (a column-wise shard), so prefill all-gathers them into
the full cache it sends on, and decode keeps its own slice of what it receives. Prefill
and decode may so run at different tensor-parallel sizes (TP 2 prefill, TP 1 decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from disagg_runtime.role.handler import SetupContext


def parallel(ctx: SetupContext) -> bool:
    return ctx.world_size > 1 and ctx.group is not None


def load(path: str, dtype: torch.dtype, ctx: SetupContext) -> Any:
    """The model sharded over the replica's ranks (kv heads must divide among them)."""
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    config = AutoConfig.from_pretrained(path)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads % ctx.world_size or config.num_attention_heads % ctx.world_size:
        raise ValueError(
            f"handlerArgs.model: {config.num_attention_heads} attention and {kv_heads} "
            f"key/value heads do not divide among {ctx.world_size} ranks (roles[].ranks)"
        )
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto")
    )


def gather_heads(tensors: Sequence[torch.Tensor], ctx: SetupContext) -> list[torch.Tensor]:
    """Each rank's (batch, kv_heads/world, T, head_dim) shards -> the whole, on every rank."""
    out = []
    for shard in tensors:
        shard = shard.contiguous()
        parts = [torch.empty_like(shard) for _ in range(ctx.world_size)]
        dist.all_gather(parts, shard, group=ctx.group)
        out.append(torch.cat(parts, dim=1))
    return out


def local_heads(tensors: Sequence[torch.Tensor], ctx: SetupContext) -> list[torch.Tensor]:
    """This rank's slice of whole (batch, kv_heads, T, head_dim) tensors."""
    out = []
    for whole in tensors:
        heads = whole.shape[1]
        if heads % ctx.world_size:
            raise ValueError(f"kv: {heads} heads do not divide among {ctx.world_size} ranks")
        width = heads // ctx.world_size
        out.append(whole[:, ctx.rank * width : (ctx.rank + 1) * width])
    return out
