"""Serving a folder to many users: continuous batching (engine), the prefix cache (prefix), the OpenAI-compatible
HTTP server (api). No torch."""
