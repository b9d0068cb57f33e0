"""Several draft servers behind one engine: ``FleetClient`` (``client``), where sessions live
(``placement``: rendezvous hashing with bounded loads, failover, shedding) and which servers
there are (``endpoints``: lists and DNS names). ``make_client`` picks DraftClient or FleetClient
from the endpoint setting.
"""

from target_client.fleet.client import FleetClient, FleetOptions, make_client
from target_client.fleet.placement import Placement, rank

__all__ = ["FleetClient", "FleetOptions", "Placement", "make_client", "rank"]
