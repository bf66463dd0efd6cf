"""vLLM workers on our KV pool: the KV connector, the server launcher and the adapters."""
