"""Drafters: the interface the engine calls (``base``), the checksum stand-in (``checksum``), and
``warm_up``. The DSpark models live in ``draft_server.models``."""

from draft_server.drafters.base import Drafter, DraftItem, DraftOut, IngestItem
from draft_server.drafters.warmup import warm_up

__all__ = ["DraftItem", "DraftOut", "Drafter", "IngestItem", "warm_up"]
