"""Dask adapters: the scheduler and worker plugins, serializers, the get_data hook, preload and the client API."""
