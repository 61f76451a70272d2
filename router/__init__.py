"""OpenAI-compatible HTTP router (FastAPI): admission, routing, streaming. Never touches a device."""
