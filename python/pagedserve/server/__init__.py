"""OpenAI-compatible HTTP server (FastAPI)."""
