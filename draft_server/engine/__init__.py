"""The engine: sessions (``sessions``), admission and KV room (``admission``), the batching loop
(``scheduler``) and the work units the I/O thread hands over (``types``)."""

from draft_server.engine.scheduler import Engine
from draft_server.engine.types import Call, Work

__all__ = ["Call", "Engine", "Work"]
