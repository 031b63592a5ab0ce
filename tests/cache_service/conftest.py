"""Fixtures for the host cache tests; the helpers live in cache_helpers.py
(a unique module name, since several test folders have a conftest)."""
from cache_helpers import backend, redis_restartable, redis_server, service, tiny_model  # noqa: F401
