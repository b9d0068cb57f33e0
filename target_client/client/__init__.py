"""The client proper: ``DraftClient`` (``facade``) and the parts it is made of.

``facade`` (public API) -> ``io_loop`` (the socket-owning thread) -> ``handshake`` (Hello/Welcome,
contract, epoch), ``breaker`` (circuit breaker), ``step_builder`` (requests to Step messages, over
the ``resend`` buffers); ``calls`` (what crosses between threads), ``counters`` (metrics, stats).
"""

from target_client.client.facade import DraftClient, StepTicket

__all__ = ["DraftClient", "StepTicket"]
