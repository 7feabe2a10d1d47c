"""verispec's OpenAI-compatible HTTP server (`verispec serve`).

Layout: `app` (the FastAPI app factory `create_app(target, settings)`: routes, validation,
response shapes), `worker` (the bounded queue and the ONE thread that owns the Target and serves
requests one at a time; cancellation and timeouts; no HTTP), `schemas` (pydantic request bodies),
`metrics` (a Prometheus registry per app). See docs/server.md.
"""

from .app import DEFAULT_MODEL_ID, ServerSettings, create_app, default_model_id

__all__ = ["DEFAULT_MODEL_ID", "ServerSettings", "create_app", "default_model_id"]
