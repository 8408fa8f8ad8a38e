"""Configuration: the ``gpupool`` namespace of ``dask.config``, read here only.

Defaults live in ``gpupool.yaml`` and each key is documented in
``gpupool-schema.yaml`` beside this module. :meth:`PoolOptions.from_config`
is the one place that reads and checks them; everything else receives a
:class:`PoolOptions`.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from dask_gpupool.errors import ConfigError

__all__ = ["KINDS", "PoolKind", "PoolOptions", "Size"]

PoolKind = Literal["auto", "device", "pinned", "host"]
KINDS: tuple[PoolKind, ...] = ("auto", "device", "pinned", "host")

_HERE = pathlib.Path(__file__).parent
with open(_HERE / "gpupool.yaml") as _f:
    _defaults = yaml.safe_load(_f)
dask.config.update_defaults(_defaults)


@dataclass(frozen=True)
class Size:
    """A pool size: either absolute bytes or a share of some capacity.

    Attributes
    ----------
    nbytes : int or None
        Absolute size in bytes.
    fraction : float or None
        Share in (0, 1] of the memory behind the pool, resolved by
        :meth:`resolve` once the capacity is known.
    """

    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: object, key: str = "gpupool.max-size") -> Size:
        """Parse ``8589934592``, ``"8 GiB"``, ``"50%"`` or ``0.5`` (also written as text, ``"0.5"``)."""
        valid = 'bytes (8589934592 or "8 GiB") or a share ("50%" or 0.5)'
        if isinstance(value, bool) or value is None:
            raise ConfigError(f"{key}={value!r} is not a size; use {valid}")
        if isinstance(value, int):
            if value <= 0:
                raise ConfigError(f"{key}={value!r} must be positive; use {valid}")
            return cls(nbytes=value)
        if isinstance(value, float):
            if not (0.0 < value <= 1.0) or math.isnan(value):
                raise ConfigError(f"{key}={value!r}: a share must be in (0, 1]; use {valid}")
            return cls(fraction=value)
        if isinstance(value, str):
            text = value.strip()
            if text.endswith("%"):
                try:
                    share = float(text[:-1]) / 100.0
                except ValueError:
                    raise ConfigError(f"{key}={value!r} is not a size; use {valid}") from None
                return cls.parse(share, key)
            if re.fullmatch(r"\d*\.\d+|\d+\.", text):
                # a decimal without a unit is a share, as the float 0.5 is: text from preload arguments
                # (--gpupool-max-size 0.5) or quoted YAML, which parse_bytes would truncate to 0 or 1 bytes
                return cls.parse(float(text), key)
            try:
                nbytes = parse_bytes(text)
            except (ValueError, TypeError, OverflowError):
                raise ConfigError(f"{key}={value!r} is not a size; use {valid}") from None
            return cls.parse(int(nbytes), key)
        raise ConfigError(f"{key}={value!r} is not a size; use {valid}")

    def resolve(self, capacity: int, what: str, key: str = "gpupool.max-size") -> int:
        """Bytes for a pool backed by ``capacity`` bytes of ``what``.

        Raises
        ------
        ConfigError
            If an absolute size exceeds ``capacity``.
        """
        if self.fraction is not None:
            return max(1, int(capacity * self.fraction))
        assert self.nbytes is not None
        if self.nbytes > capacity:
            raise ConfigError(
                f"{key}={self.nbytes} bytes exceeds the {capacity} bytes of {what}; "
                f'use at most {capacity} bytes or a share such as "50%"'
            )
        return self.nbytes

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:.0%}"
        return f"{self.nbytes} bytes"


@dataclass(frozen=True)
class PoolOptions:
    """Every option of a worker's pool, parsed and checked.

    Attributes
    ----------
    kind : {"auto", "device", "pinned", "host"}
        Requested pool kind; ``auto`` is resolved when the pool is made.
    device : int or str
        GPU ordinal in this process's ``CUDA_VISIBLE_DEVICES``, or a device UUID.
    max_size : Size
        Upper bound of the pool.
    host_id : str or None
        Host identity override; ``None`` means hostname + kernel boot id.
    broker_dir : str or None
        Parent directory of the broker's private directory, absolute (a
        relative path is taken under the worker's working directory).
    broker_timeout : float
        Seconds a broker waits for a request, and a client for a reply.
    lease_timeout : float
        Seconds after which a lease still unclaimed is logged, and for which a
        peer whose transfer failed gets copies (no timer ends a lease).
    segment_memory : {"auto", "vmm", "legacy"}
        ``device`` pools: what the segments buffers are placed in are made
        of (:mod:`dask_gpupool.memory.segments`). ``vmm``: CUDA virtual
        memory exported as POSIX fds, whose memory outlives its maker for the
        peers that map it (:mod:`dask_gpupool.memory.vmm`); ``legacy``:
        ``cuMemAlloc`` memory shared by legacy IPC handles, which outlives its
        maker too and which UCX sends GPU to GPU without a staging copy
        (:mod:`dask_gpupool.memory.legacy`; 8 and 16 GiB buffers hand over
        zero-copy on one H100). ``auto``: ``legacy`` on a worker that listens
        over UCX (on one H100 other-"host" pool arrays then went 0.75-0.85x
        of UCXX alone's path at 8 KiB-4 MiB, every pair at or below in four
        runs of five, against 0.80-0.96x with VMM segments and the staging
        copy, one to three pairs of eight above), else ``vmm``, each when the
        GPU supports it (else the other one; a GPU with neither makes no
        ``device`` pool: :func:`~dask_gpupool.memory.device_pool.segment_memory_of`
        raises :class:`~dask_gpupool.errors.ConfigError`). Either way the pool grants
        every other GPU with peer access to its GPU access, and workers there
        get its buffers zero-copy (others get copies, fallback ``other-gpu``).
    handoff_ordering : {"sync", "device"}
        How an exporter makes sure the GPU work that wrote a buffer has
        finished before a peer reads it. ``sync`` (the default): it waits
        before the descriptor goes out. For a task result of its own (a pool
        array, a pool Buffer) it waits for the event it recorded on the
        legacy default stream when Dask stored the result, which follows
        every blocking stream's earlier work, CuPy's default included:
        kernels queued since, and other streams', are not waited for. For
        anything else (a value whose event is not known) it synchronizes its
        GPU, as for every value with ``device``, which also covers work a
        task left on a non-blocking stream without waiting for it (the only
        thing ``sync`` leaves out; distributed-ucxx's comm synchronizes the
        whole of device 0).
    """

    kind: PoolKind = "auto"
    device: int | str = 0
    max_size: Size = Size(fraction=0.5)
    host_id: str | None = None
    broker_dir: str | None = None
    broker_timeout: float = 10.0
    lease_timeout: float = 60.0
    handoff_ordering: str = "sync"
    segment_memory: str = "auto"

    @classmethod
    def from_config(cls, **overrides: Any) -> PoolOptions:
        """Read ``dask.config["gpupool"]``, apply non-``None`` overrides, check all.

        Override names are the keys with ``_`` for ``-`` (``max_size=...``).

        Raises
        ------
        ConfigError
            Naming the key, the bad value and the valid values.
        """
        return cls._from(dask.config.get("gpupool", default={}) or {}, overrides)

    @classmethod
    def from_overrides(cls, **overrides: Any) -> PoolOptions:
        """The shipped defaults (``gpupool.yaml``) with non-``None`` overrides applied, all checked; this process's
        dask config is not read.

        What :class:`~dask_gpupool.GPUPool` checks where it is made (a client, or the scheduler's preload): each
        value given, and the values given against each other. The options left out are each worker's own config,
        read and checked by :meth:`from_config` on that worker, not the config of the process that made the plugin.

        Raises
        ------
        ConfigError
            Naming the key, the bad value and the valid values.
        """
        return cls._from(_defaults["gpupool"], overrides)

    @classmethod
    def _from(cls, config: dict[str, Any], overrides: dict[str, Any]) -> PoolOptions:
        # Dask treats "_" and "-" in keys alike (DASK_GPUPOOL__MAX_SIZE sets gpupool.max_size): so do we.
        raw: dict[str, Any] = {str(k).replace("_", "-"): v for k, v in config.items()}
        unknown = set(raw) - {f.replace("_", "-") for f in cls.__dataclass_fields__}
        if unknown:
            raise ConfigError(
                f"unknown option(s) {sorted('gpupool.' + k for k in unknown)}; valid: "
                f"{sorted('gpupool.' + f.replace('_', '-') for f in cls.__dataclass_fields__)}"
            )
        for name, value in overrides.items():
            if name not in cls.__dataclass_fields__:
                raise ConfigError(f"unknown option {name!r}; valid: {sorted(cls.__dataclass_fields__)}")
            if value is not None:
                raw[name.replace("_", "-")] = value
        return cls(
            kind=_parse_kind(raw.get("kind", "auto")),
            device=_parse_device(raw.get("device", 0)),
            max_size=Size.parse(raw.get("max-size", "50%")),
            host_id=_parse_optional_str(raw.get("host-id"), "gpupool.host-id"),
            broker_dir=_parse_broker_dir(raw.get("broker-dir")),
            broker_timeout=_parse_timeout(raw.get("broker-timeout", "10s"), "gpupool.broker-timeout"),
            lease_timeout=_parse_timeout(raw.get("lease-timeout", "60s"), "gpupool.lease-timeout"),
            handoff_ordering=_parse_choice(raw.get("handoff-ordering", "sync"), "gpupool.handoff-ordering", ORDERINGS),
            segment_memory=_parse_choice(raw.get("segment-memory", "auto"), "gpupool.segment-memory", SEGMENT_MEMORY),
        )


#: ``gpupool.segment-memory`` of ``device`` pools: segments of CUDA virtual memory shared by POSIX fds, or of
#: ``cuMemAlloc`` memory shared by legacy IPC handles; ``auto`` picks per worker (:mod:`dask_gpupool.memory.pool`).
SEGMENT_MEMORY = ("auto", "vmm", "legacy")

#: ``gpupool.handoff-ordering``: wait before a descriptor goes out for the task's event (else the GPU), or synchronize
#: the exporter's whole GPU before every descriptor.
ORDERINGS = ("sync", "device")


def _parse_choice(value: object, key: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(choices)}")
    return str(value)


def _parse_bool(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.strip().lower() in ("true", "yes", "1")
    raise ConfigError(f"{key}={value!r} is not a boolean; valid: true or false")


def _parse_kind(value: object) -> PoolKind:
    if value not in KINDS:
        raise ConfigError(f"gpupool.kind={value!r} is not a pool kind; valid: {', '.join(KINDS)}")
    return cast(PoolKind, value)


def _parse_device(value: object) -> int | str:
    if isinstance(value, bool):
        value = None
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str) and value.strip():
        text = value.strip()
        return int(text) if text.isdigit() else text
    raise ConfigError(f"gpupool.device={value!r} is not a device; valid: an ordinal >= 0 or a device UUID ('GPU-...')")


def _parse_optional_str(value: object, key: str) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # DASK_GPUPOOL__HOST_ID=42: Dask's environment parsing makes digits an int
    if value is None or (isinstance(value, str) and value):
        return value
    raise ConfigError(f"{key}={value!r} must be a non-empty string or null")


def _parse_broker_dir(value: object) -> str | None:
    """``gpupool.broker-dir`` as an absolute path: a relative one is under this process's working directory.

    Peers connect to the broker socket by the path in the registry row, which must be absolute.
    """
    path = _parse_optional_str(value, "gpupool.broker-dir")
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def _parse_nbytes(value: object, key: str) -> int:
    nbytes: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    elif isinstance(value, str):
        try:
            nbytes = int(parse_bytes(value))
        except (ValueError, TypeError, OverflowError):  # OverflowError: past a float ("1e400")
            nbytes = None
    if nbytes is None or nbytes < 0:
        raise ConfigError(f"{key}={value!r} is not a size; valid: '1 GiB', '256MiB', bytes, or 0 for off")
    return nbytes


def _parse_timeout(value: object, key: str) -> float:
    seconds: float | None = None
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        try:
            seconds = parse_timedelta(value, default="s")
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):  # IndexError: "" (an empty env var)
            seconds = None
    if seconds is None or seconds <= 0:
        raise ConfigError(f"{key}={value!r} is not a positive duration; valid: '10s', '500ms' or seconds")
    return float(seconds)
