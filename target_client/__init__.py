"""Thin client for the target engine: DraftClient (one server), FleetClient (several) and their
value types. Imports protocol only.

Never imports torch or draft_server: it runs inside the target engine's process (numpy,
msgspec, pyzmq and prometheus_client only). The exceptions import torch inside functions only:
``target_client.cuda`` (transport cuda_ipc, whose rows are torch CUDA tensors) and the vLLM plugin.
"""

from target_client.api import (
    ClientConfig,
    ConnectTimeoutError,
    ContractMismatchError,
    DraftClientError,
    DraftReply,
    StepRequest,
)
from target_client.client import DraftClient
from target_client.fleet import FleetClient, FleetOptions, make_client

__all__ = [
    "ClientConfig",
    "ConnectTimeoutError",
    "ContractMismatchError",
    "DraftClient",
    "DraftClientError",
    "DraftReply",
    "FleetClient",
    "FleetOptions",
    "StepRequest",
    "make_client",
]
