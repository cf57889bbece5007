"""server: the OpenAI-compatible HTTP front end of pagedserve.

Ownership: the server owns HTTP requests, their output streams, detokenizer and stop-string
state, and the request/response schemas. It never touches tensors or KV blocks: it talks to
the engine only through ``AsyncEngineClient`` (token ids in, ``RequestOutput``s out).
"""

from server.api import create_app
from server.config import ServerConfig, ServingConfig
from server.engine_client import AsyncEngineClient

__all__ = ["AsyncEngineClient", "ServerConfig", "ServingConfig", "create_app"]
