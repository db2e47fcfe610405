"""What makes the store agent-aware: trajectories waiting on a tool call and sessions with
hints, the models of when they come back, and the prefetch that pages a waiting prefix
back before it resumes. It owns the waiting trajectories (``waiting``: the wait table,
its expiry and bounds), every prediction of how long a tool call or a hinted session gap
lasts (``tool_durations``), the calibration of hinted gaps (``hint_model``), the session
table that turns hints into eviction hints (``sessions``), vLLM's ``kv_hints`` envelope
(``kv_hints``) and the prefetch scheduler (``prefetch``: a facade over the wait table,
``timing``'s due queue and thread, ``page_back``'s pager and ``stats``). It reaches blocks
only through the store's public API, in ``store_port``.
"""
