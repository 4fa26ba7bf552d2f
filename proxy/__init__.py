"""VLM Reward Proxy: score robot episodes with vision-language models served by stock vLLM."""

__version__ = "0.1.0"
