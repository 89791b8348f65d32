"""``gpuscope serve``: the instrumented reference inference server.

Importing this package (and ``config``, ``model``, ``scheduler``, ``engine``,
``service``) needs only torch and prometheus_client; the HTTP layer
(``api``, ``main``) needs aiohttp and is imported only when serving.
"""

from .config import ConfigError, ModelSpec, ServerConfig, TenantSpec, parse_tenants

__all__ = ["ConfigError", "ModelSpec", "ServerConfig", "TenantSpec", "parse_tenants"]
