"""`disagg bench vllm`: disagg's P/D against vLLM's own (NixlConnector) and one engine."""
