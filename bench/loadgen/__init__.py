"""Pieces of the load generator ``bench/load.py``, importable without a server or Ray.

workload  the seeded request mix (shared-prefix chats, unique completions, disconnects)
client    one streaming request with per-chunk timing and error classification; N clients
stats     percentiles and the run's summary
report    the JSON report, the printed table and the TTFT/ITL plot
"""
