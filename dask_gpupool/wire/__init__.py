"""Wire: typed messages that cross a process, by channel (registry, broker protocol, handoff header); never pickled."""
