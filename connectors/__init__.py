"""KV connectors: move prompt KV from prefill engines to decode engines."""
