"""Names shared by the scheduler plugin and the worker plugin: the plugin's name and its stream ops.

Every message between the two travels over the worker's own batched stream
(``Worker.batched_stream`` one way, ``Scheduler.stream_comms[worker]`` the
other), never over an RPC any comm could call (docs/security.md, "Who can
register"). Kept in a module of their own so that the scheduler side does not
import the worker side (and its pool code) for a few strings.
"""

from __future__ import annotations

__all__ = ["JOINED_OP", "MEMBERSHIP_OP", "PLUGIN_NAME", "REGISTER_OP", "REGISTRY_OP", "UNREGISTER_OP", "UPDATE_OP"]

#: Name of both plugins (``scheduler.plugins`` and ``worker.plugins``).
PLUGIN_NAME = "gpupool"

# -- worker -> scheduler (the worker's batched stream; Dask adds ``worker=<its address>``) ------------

# Dask lets a message's own keys override the ``worker=`` it adds: every op but the first carries ``key``, the
# worker's own registry key from its Membership, which no other worker has.

#: ``{"record": PoolRecord}``: register this worker's pool (answered with :data:`MEMBERSHIP_OP`; changes nothing).
REGISTER_OP = "gpupool-register"
#: ``{"record": PoolRecord, "key": bytes}``: this worker took its :class:`~dask_gpupool.wire.registry.Membership`;
#: publish this row (its earlier rows leave).
JOINED_OP = "gpupool-joined"
#: ``{"record": PoolRecord, "key": bytes}``: this worker's row changed (only ``retire_below`` may, and only grow).
UPDATE_OP = "gpupool-update"
#: ``{"pool": str, "key": bytes}``: this worker's pool leaves while the worker stays (the plugin is removed).
UNREGISTER_OP = "gpupool-unregister"

# -- scheduler -> worker (``Scheduler.stream_comms[worker]``) -------------------------------------------

#: A :class:`~dask_gpupool.wire.registry.Membership`: the registry and the cluster's token, to this worker only.
MEMBERSHIP_OP = "gpupool-membership"
#: A :class:`~dask_gpupool.wire.registry.RegistryUpdate`, to every registered (or registering) worker.
REGISTRY_OP = "gpupool-registry"
