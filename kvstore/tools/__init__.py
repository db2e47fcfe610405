"""The ``kvstore`` command line and the offline tools behind it: the command list
(``cli``, argparse value types and output checks in ``cliargs``), serve (``serve_cmd``),
stats (``stats_cmd``), repair-index (``repair_cmd``), replay of a Mooncake trace against
daemons (``replay``; the trace reader in ``trace``), the byte-less simulator (``simulate``,
``simulate_cli``) and its simulated session hints (``sim_hints``), explain-miss
(``explain_cli``), the synthetic agent-trace generator (``agent_trace``; its command
``agent_trace_cmd``) with its events file (``agent_events``), and the arguments of the
reference engine's agent demo (``agent_demo_cmd``). Owns no daemon state: a tool drives a
daemon through the client, or builds a store of its own.
"""
