"""Memory: the worker's pool of each kind, segments (RMM, arena, VMM), shared host memory, copies, UCX staging."""
