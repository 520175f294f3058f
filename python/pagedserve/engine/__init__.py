"""The engine: LLMEngine (synchronous step loop) and AsyncLLMEngine (server side)."""
