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
    assert options.handoff_ordering == "sync"  # the exporter waits (for the task's event, else its GPU) before sending
    assert PoolOptions.from_config(handoff_ordering="device").handoff_ordering == "device"


def test_the_thresholds_are_measured_constants_not_options():
    """Staging, handoff, copy-path and UCX sizes are constants of dask_gpupool.tuning, each with its measured reason
    (routes picks a pool kind's); the keys that once set them, and the alternatives that went (device-objects off,
    peer-gpu-copy, tcp-landing), are unknown options."""
    from dask_gpupool import tuning
    from dask_gpupool.handoff.routes import handoff_threshold_of, stage_threshold_of

    # plain arrays staged into device pools over TCP or TLS from 64 KiB, into host pools from 1 MiB; never over UCX,
    # nor on pinned pools
    assert [stage_threshold_of(k, True) for k in ("device", "host", "pinned")] == [64 << 10, 1 << 20, 0]
    assert stage_threshold_of("device", False) == stage_threshold_of("host", False) == 0
    # host pool buffers under 64 KiB copied (the CPU crossover); every size handed over on device and pinned pools
    assert [handoff_threshold_of(k) for k in ("host", "device", "pinned")] == [64 << 10, 0, 0]
    assert (tuning.COPY_CHUNK_SIZE, tuning.COPY_STREAM_THRESHOLD, tuning.COPY_STREAMS) == (16 << 20, 4 << 20, 4)
    assert tuning.UCX_STAGING_THRESHOLD == tuning.UCX_HOST_FRAME_THRESHOLD == 8 << 10  # UCX 1.21's eager limit
    gone = [
        "stage-threshold",
        "handoff-threshold",
        "copy-chunk-size",
        "copy-stream-threshold",
        "copy-streams",
        "ucx-staging-threshold",
        "ucx-host-frame-threshold",
        "ucx-handoff-threshold",
        "device-objects",
        "peer-gpu-copy",
        "tcp-landing",
        "lease-claims",
        "switch-interval",
    ]
    for key in gone:
        with dask.config.set({f"gpupool.{key}": 0}), pytest.raises(ConfigError, match=rf"unknown option.*{key}"):
            PoolOptions.from_config()
        with pytest.raises(ConfigError, match="unknown option"):
            PoolOptions.from_overrides(**{key.replace("-", "_"): 0})


def test_segments_are_vmm_or_legacy_ipc_memory():
    """A ``device`` pool's segments are memory that outlives its owner for the peers that map it: VMM or legacy IPC
    (``auto`` picks per worker, dask_gpupool.memory.pool); allocations of CUDA's IPC pool are no choice."""
    assert PoolOptions.from_config().segment_memory == "auto"
    assert PoolOptions.from_config(segment_memory="vmm").segment_memory == "vmm"
    assert PoolOptions.from_config(segment_memory="legacy").segment_memory == "legacy"
    for bad in ("cuda", "pool"):
        with pytest.raises(ConfigError, match=rf"gpupool\.segment-memory='{bad}'.*valid: auto, vmm, legacy$"):
            PoolOptions.from_config(segment_memory=bad)


@pytest.mark.parametrize(
    "key",
    [
        "segment-size",
        "suballocator",
        "import-limit",
        "peer-gpu-handoff",
        "cupy-allocator",
        "rmm-allocator",
        "ucx-receive-pool",
    ],
)
def test_keys_that_are_no_choice_are_unknown(key):
    """Segments of 1 GiB placed by the arena, cross-GPU handoffs where the GPUs have peer access, CuPy's and RMM's
    own allocators, and the UCX receive pool where RMM's resource is its default are what every worker does: a config
    that still sets one of these keys fails naming it, in dask config and as a ``GPUPool`` keyword."""
    with dask.config.set({f"gpupool.{key}": "auto"}), pytest.raises(ConfigError, match=rf"gpupool\.{key}"):
        PoolOptions.from_config()
    with pytest.raises(TypeError, match=key.replace("-", "_")):
        GPUPool(**{key.replace("-", "_"): "auto"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("gpupool.device", -1),
        ("gpupool.broker-timeout", "soon"),
        ("gpupool.host-id", ""),
        ("gpupool.colour", 1),
        ("gpupool.handoff-ordering", "later"),
        ("gpupool.handoff-ordering", "event"),  # measured and removed (docs/design.md)
        ("gpupool.segment-memory", "pool"),
        ("gpupool.broker-timeout", ""),  # an empty environment variable
        ("gpupool.lease-timeout", " "),
        ("gpupool.switch-interval", "0.5ms"),  # measured and removed (docs/design.md)
        ("gpupool.broker-timeout", "1e400"),  # past a float
        ("gpupool.max-size", "1e400"),
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
        plugin = GPUPool(kind="host", max_size="64MiB", segment_memory="legacy")  # ...and none of the plugin's business
        assert plugin.overrides == {"kind": "host", "max_size": "64MiB", "segment_memory": "legacy"}
        with pytest.raises(ConfigError, match=r"gpupool\.kind='gpu'"):
            GPUPool(kind="gpu")
        with pytest.raises(ConfigError, match=r"gpupool\.segment-memory='pool'"):
            GPUPool(segment_memory="pool")
