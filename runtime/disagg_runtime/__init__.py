"""disagg runtime: the data plane every role process runs (codec, pools, relays) and the CLI."""

__version__ = "0.1.0"
