"""What makes the store agent-aware: trajectories waiting on a tool call and sessions with
hints, the tool-duration and inter-turn-gap models, the prefetch scheduler that pages a
waiting prefix back before it resumes, and vLLM's ``kv_hints`` envelope. Owns the
waiting trajectories and the learned timings; reaches blocks only through the store's
public API.
"""
