"""Handoff: one worker's PoolService: routing, export and leases, import, releases, registry view, counters."""
