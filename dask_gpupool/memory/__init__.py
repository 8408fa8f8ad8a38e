"""Memory: the worker's pool of each kind, segments (arena, VMM, legacy IPC), host memory, copies, UCX staging."""
