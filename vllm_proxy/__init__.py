"""vllm-proxy: a serverless pool of vLLM engines behind one OpenAI-compatible endpoint."""

__version__ = "0.2.0"
