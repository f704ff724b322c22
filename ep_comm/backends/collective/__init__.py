"""The collective family: torch.distributed collectives over the packed tokens (``naive``, ``ag_rs``)."""
from .ag_rs import AllGatherReduceScatterBackend
from .flow import CollectiveBackend
from .naive import NaiveBackend

__all__ = ["CollectiveBackend", "NaiveBackend", "AllGatherReduceScatterBackend"]
