"""Classifier-free guidance split over the two ranks of a denoiser replica (issue 33).

diffusers' own answer, context parallel (`transformer.enable_parallelism(config=
ContextParallelConfig(...))`), does not run on CPU: 0.42 places each rank on
`rank % torch.accelerator.device_count()`, a modulo by zero without an accelerator. So a
denoiser of `ranks: 2` splits the work it can split without changing a number: each
denoising step calls the transformer twice, once with the prompt (cond) and once with the
negative prompt (uncond); rank 0 computes cond and rank 1 uncond at the same time, an
all-gather gives both to both, and the pipeline's own loop goes on as in one process:

    pipeline step:  noise_pred = T(x, prompt)      -> here: rank r computes T(x, embeds[r]),
                                                      all_gather -> [cond, uncond]; cond
                    noise_uncond = T(x, negative)  -> here: uncond, from the gather
                    guidance, scheduler step       -> unchanged, on every rank

Each branch is the same computation as in one process, so the latents are equal to one
rank's (tests/integration/test_ranked_models.py checks them bit for bit). Without
guidance (scale <= 1, no negative prompt) every rank computes the one call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from disagg_runtime.role.handler import SetupContext


class CfgSplit:
    """Installed on a transformer as its `forward`: the pair of calls of each step, shared."""

    def __init__(self, transformer: Any, ctx: SetupContext) -> None:
        if ctx.world_size != 2:
            raise ValueError(
                f"roles[].ranks: the denoiser splits guidance over 2 ranks, not {ctx.world_size}"
            )
        self.forward = transformer.forward
        self.ctx = ctx
        self.negative: torch.Tensor | None = None  # set per request; None: no guidance
        self._uncond: torch.Tensor | None = None
        transformer.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.negative is None:
            return self.forward(*args, **kwargs)
        if self._uncond is not None:  # the step's second call: computed by rank 1 already
            uncond, self._uncond = self._uncond, None
            return (uncond,)
        prompt = kwargs["encoder_hidden_states"]
        if self.ctx.rank == 1:
            kwargs["encoder_hidden_states"] = self.negative.to(prompt.device, prompt.dtype)
        mine = self.forward(*args, **{**kwargs, "return_dict": False})[0].contiguous()
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=self.ctx.group)
        self._uncond = both[1]
        return (both[0],)
