"""adstream workloads room: a market simulator with ground truth, dataset replay, event load.

Start here: `from workloads import Market, MarketConfig`; see `workloads.market` for the API.
"""

from workloads.config import MarketConfig
from workloads.entities import Event, Request, UnknownEntityError
from workloads.market import Market
from workloads.summary import Summary

__all__ = ["Event", "Market", "MarketConfig", "Request", "Summary", "UnknownEntityError"]
