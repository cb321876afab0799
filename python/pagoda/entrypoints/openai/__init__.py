"""Pagoda's OpenAI-compatible HTTP server (Starlette + uvicorn): see api_server."""
