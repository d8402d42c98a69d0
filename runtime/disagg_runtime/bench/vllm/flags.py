"""`disagg bench vllm`'s arguments (light: the CLI builds its parser without the bench)."""

from __future__ import annotations

import argparse

SETUPS = ("single", "disagg", "nixl")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--file", default=None, help="disagg's P/D pipeline (default examples/vllm-pd.yaml)"
    )
    p.add_argument("--model", help="tiny vLLM model directory (default: write one to a temp dir)")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="levels (default 1,8,32)")
    p.add_argument(
        "--requests", type=_ints, default=[8, 16, 32], help="requests per level (8,16,32)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma list of {', '.join(SETUPS)}")
    p.add_argument("--engine-python", help="the vLLM env's interpreter (default: as disagg up)")
    p.add_argument("--json", action="store_true", help="print JSON")
