"""`disagg request URL`: one request to a gateway, the answer on stdout (or --output).

The body is `--input FILE.json` as it stands (a native `{"inputs": ...}` body, or an
OpenAI one when URL names such a route), or `--sample N --file PIPELINE.yaml`: the entry
handler's sample input N, as `disagg up` builds it, in the native JSON encoding. A URL
without a path means `/v1/infer`. With `--stream` the events are printed as they arrive.
Exit status 0 for a 2xx answer, 1 otherwise (the error body goes to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import IO

DEFAULT_PATH = "/v1/infer"


def target(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL")
    return url if parts.path not in ("", "/") else url.rstrip("/") + DEFAULT_PATH


def sample_body(file: str, index: int) -> bytes:
    from disagg_core.spec import load_pipeline_file
    from disagg_runtime.gateway import native
    from disagg_runtime.role.handler import input_factory

    payload = input_factory(load_pipeline_file(file))(index)
    return native.dumps({"inputs": native.to_json(payload)})


def body_of(args: argparse.Namespace) -> bytes:
    if args.input:
        with open(args.input, "rb") as f:
            return f.read()
    if args.sample is not None:
        if not args.file:
            raise ValueError("--sample needs --file PIPELINE.yaml (whose entry handler builds it)")
        return sample_body(args.file, args.sample)
    raise ValueError("give --input FILE.json or --sample N")


def send(
    url: str, body: bytes, *, stream: bool, token: str | None, timeout: float, out: IO[bytes]
) -> int:
    headers = {"Content-Type": "application/json"}
    if stream:
        headers["Accept"] = "text/event-stream"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if stream:
                for line in resp:  # one line at a time, as the events arrive
                    out.write(line)
                    out.flush()
            else:
                out.write(resp.read())
        return 0
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        sys.stderr.write(f"disagg request: HTTP {exc.code}: {detail}\n")
        return 1


def run_cli(args: argparse.Namespace) -> int:
    try:
        url = target(args.url)
        body = body_of(args)
    except (ValueError, OSError) as exc:
        print(f"disagg request: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        out: IO[bytes] = (
            stack.enter_context(open(args.output, "wb")) if args.output else sys.stdout.buffer
        )
        try:
            code = send(
                url, body, stream=args.stream, token=args.token, timeout=args.timeout, out=out
            )
        except (urllib.error.URLError, OSError) as exc:
            print(f"disagg request: {url}: {exc}", file=sys.stderr)
            return 1
        if not args.output and not args.stream:
            out.write(b"\n")
    return code
