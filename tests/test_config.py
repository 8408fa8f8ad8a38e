from __future__ import annotations

import os
import pathlib

import dask.config
import pytest
import yaml

from dask_gpupool import ConfigError, GPUPool, PoolOptions
from dask_gpupool.config import Size

HERE = pathlib.Path(__file__).parent.parent / "dask_gpupool"


def test_defaults_are_read_from_dask_config():
    options = PoolOptions.from_config()
    assert options == PoolOptions()
    assert dask.config.get("gpupool.kind") == "auto"


def test_every_default_is_documented_in_the_schema():
    defaults = yaml.safe_load((HERE / "gpupool.yaml").read_text())["gpupool"]
    schema = yaml.safe_load((HERE / "gpupool-schema.yaml").read_text())["properties"]["gpupool"]["properties"]
    assert set(defaults) == set(schema)
    assert all(schema[k].get("description") for k in schema)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, Size(nbytes=4096)),
        ("8 GiB", Size(nbytes=8 * 2**30)),
        ("64MiB", Size(nbytes=64 * 2**20)),
        ("50%", Size(fraction=0.5)),
        (0.25, Size(fraction=0.25)),
    ],
)
def test_sizes_parse(value, expected):
    assert Size.parse(value) == expected


@pytest.mark.parametrize("value", ["lots", "150%", 0, -1, 1.5, True, None, "0%", [1]])
def test_bad_sizes_name_the_key(value):
    with pytest.raises(ConfigError, match=r"gpupool\.max-size"):
        Size.parse(value)


def test_size_beyond_capacity_names_the_key_and_the_limit():
    with pytest.raises(ConfigError, match=r"gpupool\.max-size=.*exceeds the 1000 bytes of GPU 0"):
        Size(nbytes=2000).resolve(1000, "GPU 0")
    assert Size(fraction=0.5).resolve(1000, "x") == 500


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ConfigError, match=r"gpupool\.kind='gpu'.*auto, device, pinned, host"):
        PoolOptions.from_config(kind="gpu")


def test_config_values_and_overrides():
    with dask.config.set({"gpupool.kind": "host", "gpupool.max-size": "1 GiB", "gpupool.broker-timeout": "500ms"}):
        options = PoolOptions.from_config(device="GPU-abc")
    assert options.kind == "host"
    assert options.max_size == Size(nbytes=2**30)
    assert options.broker_timeout == 0.5
    assert options.device == "GPU-abc"
    assert options.segment_size == 2**30 and options.cupy_allocator is None
    assert options.peer_gpu_handoff is True and options.suballocator == "auto"  # "auto": on with segments
    assert PoolOptions.from_config(cupy_allocator="true").cupy_allocator is True
    no_segments = PoolOptions.from_config(segment_size=0)
    assert no_segments.segment_size == 0 and no_segments.peer_gpu_handoff is False
    assert PoolOptions.from_config(peer_gpu_handoff="false").peer_gpu_handoff is False
    assert options.peer_gpu_copy is False  # off until its GPU tests pass (docs/gpu-checks.md, twelfth session)
    assert PoolOptions.from_config(peer_gpu_copy="true").peer_gpu_copy is True
    assert options.handoff_ordering == "sync"  # the exporter waits (for the task's event, else its GPU) before sending
    assert options.device_objects is True  # "cuda"-serialized objects frame by frame to same-host workers
    assert PoolOptions.from_config(device_objects=False).device_objects is False
    assert PoolOptions.from_config(handoff_ordering="device").handoff_ordering == "device"
    assert options.tcp_landing == "auto"  # vkgdr where it runs (faster on an H100), pinned staging elsewhere
    assert PoolOptions.from_config(tcp_landing="pinned").tcp_landing == "pinned"
    assert PoolOptions.from_config(suballocator="arena").suballocator == "arena"
    assert options.import_limit is None  # auto: 5 GiB for allocations of CUDA's IPC pool, none for VMM or legacy ones
    assert (options.effective_import_limit(pool_memory=False), options.effective_import_limit(pool_memory=True)) == (
        0,
        5 << 30,
    )
    assert PoolOptions.from_config(import_limit="8 GiB").effective_import_limit(pool_memory=False) == 8 << 30
    assert PoolOptions.from_config(segment_memory="pool", segment_size="8 GiB").segment_size == 5 << 30
    assert PoolOptions.from_config(segment_memory="legacy", segment_size="8 GiB").segment_size == 8 << 30
    assert PoolOptions.from_config(segment_size="8 GiB").segment_size == 8 << 30  # VMM segments of any size
    assert options.ucx_handoff_threshold == 0
    assert PoolOptions.from_config(ucx_handoff_threshold="64 MiB").ucx_handoff_threshold == 64 << 20
    assert options.ucx_staging_threshold == 8 << 10  # smaller pool values go to UCX as they are
    assert PoolOptions.from_config(ucx_staging_threshold="64 KiB").ucx_staging_threshold == 64 << 10
    assert options.ucx_host_frame_threshold == 8 << 10  # smaller CuPy arrays go over UCX as one host frame
    assert PoolOptions.from_config(ucx_host_frame_threshold=0).ucx_host_frame_threshold == 0
    assert options.ucx_receive_pool is None  # auto: 1 GiB on UCX workers whose RMM resource is RMM's default
    assert PoolOptions.from_config(ucx_receive_pool="256 MiB").ucx_receive_pool == 256 << 20
    assert PoolOptions.from_config(ucx_receive_pool=False).ucx_receive_pool == 0
    assert PoolOptions.from_config(ucx_receive_pool="true").ucx_receive_pool == 1 << 30
    assert PoolOptions.from_config(import_limit=0, segment_size="8 GiB").segment_size == 8 * 2**30
    assert (options.copy_chunk_size, options.copy_stream_threshold, options.copy_streams) == (16 << 20, 4 << 20, 4)
    assert PoolOptions.from_config(copy_streams="2", copy_chunk_size=0).copy_streams == 2
    # auto: on device pools 64 KiB to a worker on the same GPU over TCP (paired on one H100) or another (paired on two
    # H200s); off on host pools
    assert options.stage_threshold is None
    assert (options.effective_stage_threshold("device"), options.effective_stage_threshold("host")) == (64 << 10, 0)
    assert options.effective_stage_threshold("device", same_gpu=True) == 64 << 10
    assert options.effective_stage_threshold("host", same_gpu=True) == 0
    assert options.effective_stage_threshold("device", same_gpu=True, over_tcp=False) == 0  # auto over UCX: never
    set_by_user = PoolOptions.from_config(stage_threshold="1 MiB")
    assert set_by_user.effective_stage_threshold("device", same_gpu=True) == 1 << 20
    assert PoolOptions.from_config(stage_threshold="1 MiB").effective_stage_threshold("host") == 1 << 20
    assert options.handoff_threshold is None  # auto: the crossovers measured on the CPU, one H100 and H200s; pinned: 0
    assert [options.effective_handoff_threshold(k) for k in ("host", "device", "pinned")] == [64 << 10, 0, 0]
    assert [options.effective_handoff_threshold(k, same_gpu=True) for k in ("host", "device", "pinned")] == [
        64 << 10,
        0,
        0,
    ]
    assert PoolOptions.from_config(handoff_threshold=0).effective_handoff_threshold("host") == 0
    assert PoolOptions.from_config(handoff_threshold="1 MiB").effective_handoff_threshold("device") == 1 << 20


def test_cross_gpu_handoffs_need_segments_of_vmm_or_legacy_ipc_memory():
    """Pool memory read from another GPU after its owner died breaks the reader (dask_gpupool.memory.vmm); VMM and
    legacy IPC memory do not (dask_gpupool.memory.legacy)."""
    assert PoolOptions.from_config().segment_memory == "auto"
    pool_memory = PoolOptions.from_config(segment_memory="pool")
    assert pool_memory.segment_memory == "pool" and pool_memory.peer_gpu_handoff is False
    assert PoolOptions.from_config(segment_memory="vmm").peer_gpu_handoff is True
    legacy = PoolOptions.from_config(segment_memory="legacy", peer_gpu_handoff=True)
    assert legacy.segment_memory == "legacy" and legacy.peer_gpu_handoff is True
    assert PoolOptions.from_config(segment_memory="legacy").peer_gpu_handoff is True
    for bad in ({"segment_memory": "pool", "peer_gpu_handoff": True}, {"segment_size": 0, "peer_gpu_handoff": "true"}):
        with pytest.raises(ConfigError, match="peer-gpu-handoff=true needs segments of VMM or legacy IPC memory"):
            PoolOptions.from_config(**bad)
    with pytest.raises(ConfigError, match=r"gpupool\.segment-memory='cuda'.*valid: auto, vmm, legacy, pool"):
        PoolOptions.from_config(segment_memory="cuda")


def test_segments_are_at_most_the_import_limit():
    assert PoolOptions.from_config(segment_size="6 GiB", segment_memory="pool").segment_size == 5 << 30
    # single legacy IPC imports of 8 and 16 GiB hand over on one H100 (tests/test_gpu.py): not bounded
    assert PoolOptions.from_config(segment_size="6 GiB", segment_memory="legacy").segment_size == 6 << 30
    assert PoolOptions.from_config(import_limit="64 MiB").segment_size == 64 << 20


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("gpupool.device", -1),
        ("gpupool.broker-timeout", "soon"),
        ("gpupool.host-id", ""),
        ("gpupool.colour", 1),
        ("gpupool.segment-size", "big"),
        ("gpupool.segment-size", -1),
        ("gpupool.import-limit", "huge"),
        ("gpupool.ucx-handoff-threshold", "big"),
        ("gpupool.ucx-staging-threshold", "-1"),
        ("gpupool.ucx-host-frame-threshold", "-8 KiB"),
        ("gpupool.ucx-receive-pool", "plenty"),
        ("gpupool.ucx-receive-pool", "-1 GiB"),
        ("gpupool.copy-chunk-size", "-1 MiB"),
        ("gpupool.copy-chunk-size", "2 GiB"),  # each lane stages three chunks
        ("gpupool.copy-stream-threshold", "some"),
        ("gpupool.stage-threshold", "-4 MiB"),
        ("gpupool.copy-streams", 0),
        ("gpupool.copy-streams", 17),
        ("gpupool.copy-streams", "four"),
        ("gpupool.suballocator", "jemalloc"),
        ("gpupool.peer-gpu-handoff", "sometimes"),
        ("gpupool.peer-gpu-copy", "sometimes"),
        ("gpupool.handoff-ordering", "later"),
        ("gpupool.handoff-ordering", "event"),  # measured and removed (docs/design.md)
        ("gpupool.lease-claims", "reply"),  # measured and removed: leases are claimed by the reply
        ("gpupool.tcp-landing", "host"),
        ("gpupool.broker-timeout", ""),  # an empty environment variable
        ("gpupool.lease-timeout", " "),
        ("gpupool.switch-interval", "0.5ms"),  # measured and removed (docs/design.md)
        ("gpupool.broker-timeout", "1e400"),  # past a float
        ("gpupool.max-size", "1e400"),
        ("gpupool.segment-size", "1e400"),
        ("gpupool.stage-threshold", "1e400 B"),
    ],
)
def test_bad_config_values_name_the_key(key, value):
    with dask.config.set({key: value}), pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        PoolOptions.from_config()


def test_underscores_in_keys_are_dashes_as_in_dask(monkeypatch):
    monkeypatch.setenv("DASK_GPUPOOL__MAX_SIZE", "3 GiB")
    monkeypatch.setenv("DASK_GPUPOOL__LEASE_TIMEOUT", "5s")
    config = dask.config.collect(env=dict(os.environ))
    with dask.config.set(gpupool=config["gpupool"]):
        options = PoolOptions.from_config()
    assert options.max_size == Size(nbytes=3 * 2**30) and options.lease_timeout == 5.0


def test_an_empty_environment_variable_is_a_config_error_naming_the_key(monkeypatch):
    monkeypatch.setenv("DASK_GPUPOOL__BROKER_TIMEOUT", "")
    config = dask.config.collect(env=dict(os.environ))
    with dask.config.set(gpupool=config["gpupool"]), pytest.raises(ConfigError, match=r"gpupool\.broker-timeout"):
        PoolOptions.from_config()


def test_a_host_id_of_digits_from_the_environment_is_a_string(monkeypatch):
    """Dask reads ``DASK_GPUPOOL__HOST_ID=42`` as the integer 42: still a host identity, the same on every worker."""
    monkeypatch.setenv("DASK_GPUPOOL__HOST_ID", "42")
    config = dask.config.collect(env=dict(os.environ))
    with dask.config.set(gpupool=config["gpupool"]):
        assert PoolOptions.from_config().host_id == "42"


def test_plugin_checks_options_when_built():
    with pytest.raises(ConfigError, match=r"gpupool\.max-size"):
        GPUPool(max_size="a lot")
    assert GPUPool(kind="host", max_size="1GiB").overrides == {"kind": "host", "max_size": "1GiB"}


def test_every_config_key_is_a_keyword_of_the_plugin():
    """``GPUPool(...)`` takes every ``gpupool.*`` key of the defaults (dashes as underscores), so that a setting
    can be given to the plugin as to dask config."""
    import inspect

    import dask_gpupool

    defaults = yaml.safe_load((pathlib.Path(dask_gpupool.__file__).parent / "gpupool.yaml").read_text())["gpupool"]
    keywords = set(inspect.signature(GPUPool.__init__).parameters)
    assert {k.replace("-", "_") for k in defaults} - keywords == set()


@pytest.mark.parametrize(("text", "share"), [("0.5", 0.5), (" 0.25 ", 0.25), ("1.0", 1.0), (".75", 0.75)])
def test_a_share_written_as_text_is_a_share(text, share):
    """Preload arguments are text (``--gpupool-max-size 0.5``), as a quoted YAML value is: ``0.5`` was read as
    ``parse_bytes("0.5")``, 0 bytes, refused with a message that suggests 0.5; ``1.5`` made a one-byte pool."""
    assert Size.parse(text) == Size(fraction=share)
    assert PoolOptions.from_config(max_size=text).max_size == Size(fraction=share)


@pytest.mark.parametrize("text", ["1.5", "2.0", "0.0"])
def test_a_decimal_written_as_text_outside_a_share_is_refused(text):
    with pytest.raises(ConfigError, match=r"gpupool\.max-size=.*a share must be in \(0, 1\]"):
        Size.parse(text)


def test_the_plugin_checks_the_options_it_was_given_not_this_processs_config():
    """``GPUPool(...)`` checked its options against the dask config of the process that made it (a client): a bad or
    conflicting ``gpupool.*`` value there, which no worker reads, failed it. The options given are still checked,
    each on its own and against each other."""
    client_config = {"gpupool.kind": "gpu", "gpupool.segment-memory": "pool", "gpupool.kidn": "host"}
    with dask.config.set(client_config):
        with pytest.raises(ConfigError):
            PoolOptions.from_config()  # this process's own config is bad...
        plugin = GPUPool(kind="host", max_size="64MiB", peer_gpu_handoff=True)  # ...and none of the plugin's business
        assert plugin.overrides == {"kind": "host", "max_size": "64MiB", "peer_gpu_handoff": True}
        with pytest.raises(ConfigError, match=r"gpupool\.kind='gpu'"):
            GPUPool(kind="gpu")
        with pytest.raises(ConfigError, match=r"rmm-allocator and gpupool\.cupy-allocator"):
            GPUPool(rmm_allocator=True, cupy_allocator=True)
        with pytest.raises(ConfigError, match=r"peer-gpu-handoff=true needs segments"):
            GPUPool(peer_gpu_handoff=True, segment_memory="pool")
    with dask.config.set({"gpupool.cupy-allocator": True}):
        GPUPool(rmm_allocator=True)  # a conflict with this process's config only: the workers' configs decide
