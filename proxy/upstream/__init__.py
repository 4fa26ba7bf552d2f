"""Calls to `vllm serve`: the one client (aiohttp) and the only place its failures are translated,
the endpoint pool (balancing, circuits, admission), the retry policy, backends, readiness probes."""
