"""Pieces of the serving benchmark (`bench/serve_bench.py`).

`client` sends one streamed OpenAI request and times it, `datasets` builds the prompts
(synthetic shared prefixes, Mooncake traces, reuse-table prompts), `load` drives the arrival
process, `metrics` turns the per-request records into vLLM-style numbers, `reuse` measures cold
vs cached TTFT, `deploy` starts or attaches to a deployment and `report` prints the tables.
"""
