"""The client's side of the shared block table (:mod:`tiers.block_table`), for the client."""

from tiers.block_table import TableView, supported

__all__ = ["TableView", "supported"]
