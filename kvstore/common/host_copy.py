"""Host memory copies at memory speed (:mod:`tiers.host_copy`), for the client and the adapters."""

from tiers.host_copy import copy, copy_slots, copy_spans, gather_ranges, words_enabled

__all__ = ["copy", "copy_slots", "copy_spans", "gather_ranges", "words_enabled"]
