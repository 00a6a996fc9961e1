"""The one validated configuration object, parsed once from ``kv_connector_extra_config``.

Every path into :class:`TierStoreConfig` goes through ``__post_init__``, so a bad value
fails at start-up with a message that names the key, never later inside a step.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Literal

from tierstore.errors import ConfigError

# Keys that vLLM's OffloadingConnector itself reads from the same extra config. They are
# accepted (and left to vLLM) so that a typo in tierstore's own keys can still be caught.
VLLM_OWNED_KEYS: frozenset[str] = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "blocks_per_chunk",
        "block_size",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        "sync_load_budget_bytes",
        "cpu_bytes_to_use",  # set by --kv-offloading-size; tierstore ignores it
    }
)

_MAX_PIN_CHARS = 256  # a model_identity names weights; anything longer is a mistake
DEFAULT_NAMESPACE = "tierstore"
AUTO_SHARDS: Final = "auto"  # evictor_shards chosen from the node count (evictor_shards_for)
# Pinned host memory each CUDA worker reserves at start for jobs that do not go through
# the node's arena (the object-store path): a 16k-token job of an 8B Llama fits whole.
DEFAULT_PINNED_BOUNCE_BYTES = 256 << 20
MIN_PINNED_BOUNCE_BYTES = 1 << 20  # below a MiB every job would go in tiny pieces

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
# A size is ASCII digits, an optional decimal part and a unit, matched in full. Not \d:
# Python's \d, int() and float() also take other scripts' digits (Arabic-Indic "12GiB" was 12 GiB).
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", re.ASCII)
# Matched in full (re.fullmatch): "$" would also accept a trailing newline.
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)
# The largest byte size of a tier: 1 EiB, beyond any node's memory or disk. Larger ones
# only fail later, far from the key: sizing a file past 2**63 bytes overflows the OS call.
MAX_BYTES = 1 << 60
# The longest duration of any key (timeouts, leases, ages): a day. Each is a deadline or a
# lease that people set in milliseconds to minutes; past about 9.2e9 s Python's and Ray's
# waits overflow (threading.TIMEOUT_MAX), and a day-long lease already pins a chunk all day.
MAX_DURATION_S = 86_400.0
MAX_DURATION_MS = MAX_DURATION_S * 1000
# Keys given as true/false (or "yes"/"no", "1"/"0", ... as strings).
_BOOL_KEYS = ("disk_fsync", "hits_from_picture")


def parse_bytes(key: str, value: object, minimum: int = 0) -> int:
    """Parse a byte size given as an int or a string such as ``"8GiB"`` or ``"512MB"``,
    from ``minimum`` to :data:`MAX_BYTES`. A decimal with a unit is rounded down to whole
    bytes ("1.1GiB"); without one it must be whole ("0.5" is refused, not read as 0).
    Every error quotes ``value`` as the user wrote it."""
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        size = _parse_size_text(key, value)
    if size is None:
        raise ConfigError(
            f"{key}: expected a byte size such as 1073741824 or '1GiB', got {value!r}"
        )
    if not minimum <= size <= MAX_BYTES:
        parsed = "" if size == value else f" (= {size} bytes)"
        raise ConfigError(
            f"{key}: expected {minimum} to {MAX_BYTES} bytes (1 EiB), got {value!r}{parsed}"
        )
    return size


def _parse_size_text(key: str, text: str) -> int | None:
    """Whole bytes of ``text`` (exact: a Fraction, never a float), or None if it is no size."""
    match = _SIZE_RE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        return None
    exact = Fraction(match.group(1)) * _SIZE_UNITS[unit]
    if exact.denominator != 1 and _SIZE_UNITS[unit] == 1:
        raise ConfigError(
            f"{key}: a byte count is a whole number, got {text!r}; write e.g. '512KiB'"
        )
    return math.floor(exact)


def parse_bool(key: str, value: object) -> bool:
    """Parse a boolean strictly: ``"false"`` must not become ``True``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"true", "1", "yes", "on"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"false", "0", "no", "off"}:
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


@dataclass(frozen=True)
class TierStoreConfig:
    """tierstore's settings for one engine (and for the actors it starts)."""

    # Bytes of chunk data each node's CPU tier may hold. Required: there is no safe default.
    cpu_bytes_per_node: int
    # Ray namespace that holds every tierstore actor; engines sharing it share chunks.
    namespace: str = DEFAULT_NAMESPACE
    # Ray cluster to join ("ip:port" or "auto"); None = RAY_ADDRESS, then a running local
    # cluster, then a new local one.
    ray_address: str | None = None
    # Seconds a HIT stays reserved for the engine that saw it before the Evictor may evict it.
    lease_ttl_s: float = 30.0
    # Milliseconds a request waits for tierstore's answer to a lookup before it proceeds
    # as a miss. The Evictor answers in 1-2 scheduler steps when healthy (tens of ms);
    # this bounds what a slow or restarting Evictor costs a request.
    lookup_timeout_ms: float = 200.0
    # Milliseconds a scheduler's cluster view (which chunks the cluster holds) may be old and
    # still answer a lookup MISS without asking the Evictor (refreshed twice as often).
    # A chunk another engine stored within this window is recomputed; 0 = ask every key.
    presence_max_age_ms: float = 200.0
    # While that view is fresh, a chunk it shows in some node's memory is a HIT at
    # once (its lease is taken meanwhile), so the request is scheduled a step sooner. Only
    # under kv_load_failure_policy "recompute": a chunk evicted in between fails its load,
    # and the request recomputes.
    hits_from_picture: bool = True
    # Seconds a worker waits for a NodeStore before failing the engine loudly.
    transfer_timeout_s: float = 120.0
    # Directory of each node's disk tier; None = no disk tier. Survives restarts.
    disk_path: str | None = None
    # Bytes of chunk data each node's disk tier may hold; 0 = no disk tier.
    disk_bytes_per_node: int = 0
    # fsync every chunk file before publishing it: survives power loss, costs a flush
    # per chunk (measured in deploy/bench). Off: a crash loses only unsynced chunks, and
    # a torn file fails its checksum, so it is never served.
    disk_fsync: bool = False
    # Eviction policy over prefix boundaries: "lru" or "arc".
    eviction_policy: str = "lru"
    # Demote CPU chunks to disk once a node's CPU tier passes this fraction...
    cpu_high_watermark: float = 0.95
    # ...down to this fraction, so stores keep finding room without waiting.
    cpu_low_watermark: float = 0.85
    # A node that loaded a chunk from another node this many times gets a copy of it in
    # its own CPU tier, if that fits below cpu_low_watermark (a copy never evicts
    # anything). Later loads there are local, and survive the holder's loss. 0 = never.
    replicate_after_loads: int = 2
    # Pulls at lookup: a lookup from a node that answers HIT for chunks held only on
    # other nodes has that node's NodeStore copy them into its own CPU tier at once (a
    # hot-chunk copy: only if it fits below cpu_low_watermark, evicted first, never
    # written to disk), one pull per holder and request, at most this many at once per
    # node; the engine's load then reads its node's copy, or waits for the pull. 0 = no
    # pulls at lookup (a load pulls when it starts).
    pulls_per_node: int = 4
    # How a pull's bytes cross between nodes: "object_store" (the holder puts the shards
    # into Ray's object store, the puller copies them into its arena) or "nixl" (the
    # puller reads the holder's arena extents straight into its own over NIXL, no copy
    # on either side; needs the nixl package on every node).
    pull_transport: str = "object_store"
    # Evictor shards: each owns the prefix trees whose first chunk hashes to it (their
    # index, leases and eviction), and 1/evictor_shards of every node's tiers. Lookups
    # and admits of one prefix go to one shard; more shards serve more nodes. "auto":
    # evictor_shards_for(the alive nodes) when shard 0 first starts; every later process
    # adopts the number shard 0 runs with (the actors' own configs always name a number:
    # read it with ``shard_count``).
    evictor_shards: int | Literal["auto"] = AUTO_SHARDS
    # Pins the model part of the namespace to this name, in place of vLLM's model hash,
    # the model's name and the fingerprint of its weights (the cache settings and the
    # page shape still count): engines that load the same weights from different paths
    # then share chunks. A promise tierstore cannot check: another model under the same
    # pin reads the first one's KV as its own. None = derived from the engine.
    model_identity: str | None = None
    # Pinned host memory (bytes, or "256MiB") each CUDA worker reserves at start, once,
    # for jobs not copied through the node's arena; a job larger than what is free goes
    # in pieces through part of it. Per rank: TP ranks each reserve it. Unused on CPU.
    pinned_bounce_bytes: int = DEFAULT_PINNED_BOUNCE_BYTES

    def __post_init__(self) -> None:
        # One small validator per field or relation, in a fixed order (see ``_CHECKS``).
        for check in _CHECKS:
            check(self)

    @classmethod
    def from_extra_config(
        cls, extra_config: Mapping[str, Any], ray_address_env: str | None = None
    ) -> TierStoreConfig:
        """Build from vLLM's ``kv_connector_extra_config``; ``RAY_ADDRESS`` is passed in."""
        own_keys = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra_config) - own_keys - VLLM_OWNED_KEYS, key=repr)
        if unknown:
            hints = []
            for key in unknown:
                known = sorted(own_keys | VLLM_OWNED_KEYS)
                close = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                "unknown kv_connector_extra_config key(s): "
                + ", ".join(hints)
                + f". tierstore's keys are: {', '.join(sorted(own_keys))}"
            )
        if "cpu_bytes_per_node" not in extra_config:
            raise ConfigError(
                "cpu_bytes_per_node: missing from kv_connector_extra_config; set it to the "
                'bytes each node\'s CPU tier may hold, e.g. "cpu_bytes_per_node": "4GiB"'
            )
        kwargs: dict[str, Any] = {k: extra_config[k] for k in own_keys if k in extra_config}
        kwargs["cpu_bytes_per_node"] = parse_bytes(
            "cpu_bytes_per_node", kwargs["cpu_bytes_per_node"], minimum=1
        )
        if "pinned_bounce_bytes" in kwargs:
            kwargs["pinned_bounce_bytes"] = parse_bytes(
                "pinned_bounce_bytes", kwargs["pinned_bounce_bytes"], MIN_PINNED_BOUNCE_BYTES
            )
        if "disk_bytes_per_node" in kwargs:
            kwargs["disk_bytes_per_node"] = parse_bytes(
                "disk_bytes_per_node", kwargs["disk_bytes_per_node"]
            )
        for key in _BOOL_KEYS:
            if key in kwargs:
                kwargs[key] = parse_bool(key, kwargs[key])
        if kwargs.get("ray_address") is None and ray_address_env:
            kwargs["ray_address"] = ray_address_env
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def shard_count(self) -> int:
        """``evictor_shards`` as a number: for the actors' configs and the configs the
        bootstrap resolved (``tierstore.actors.bootstrap``), which always name one. Raises
        :class:`~tierstore.errors.ConfigError` while it is ``"auto"`` (nothing resolved
        this config)."""
        if isinstance(self.evictor_shards, int):
            return self.evictor_shards
        raise ConfigError(
            f"evictor_shards: {self.evictor_shards!r} is chosen when Evictor shard 0 starts; "
            "this config has not been resolved against the running shards"
        )


# ---- validators: each checks one field (or one relation) and names it in its error ------
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_cpu_bytes(cfg: TierStoreConfig) -> None:
    if not _is_int(cfg.cpu_bytes_per_node):
        raise ConfigError(
            f"cpu_bytes_per_node: expected an integer byte count, got {cfg.cpu_bytes_per_node!r}"
        )
    parse_bytes("cpu_bytes_per_node", cfg.cpu_bytes_per_node, minimum=1)


def _check_bool(cfg: TierStoreConfig, key: str) -> None:
    if not isinstance(getattr(cfg, key), bool):
        raise ConfigError(f"{key}: expected true or false, got {getattr(cfg, key)!r}")


def _check_namespace(cfg: TierStoreConfig) -> None:
    if not isinstance(cfg.namespace, str) or not _NAMESPACE_RE.fullmatch(cfg.namespace):
        raise ConfigError(
            f"namespace: expected 1-64 letters, digits, '_', '.' or '-', got {cfg.namespace!r}"
        )


def _check_ray_address(cfg: TierStoreConfig) -> None:
    address = cfg.ray_address
    if address is None:
        return
    # Printable ASCII without spaces: "ip:port", "auto", "ray://host:port", "[::1]:6379".
    if not isinstance(address, str) or not address.isascii() or not address.isprintable():
        raise ConfigError(f"ray_address: expected 'ip:port' or 'auto', got {address!r}")
    if not address or any(c.isspace() for c in address):
        raise ConfigError(f"ray_address: expected 'ip:port' or 'auto', got {address!r}")


def _check_model_identity(cfg: TierStoreConfig) -> None:
    pin = cfg.model_identity
    if pin is None:
        return
    if (
        not isinstance(pin, str)
        or not 0 < len(pin) <= _MAX_PIN_CHARS
        or not pin.isascii()
        or not pin.isprintable()
    ):
        raise ConfigError(
            f"model_identity: expected 1-{_MAX_PIN_CHARS} printable ASCII characters naming "
            f"the weights (e.g. 'llama-3-8b@sha256:ab12...'), got {pin!r}"
        )


def _check_disk(cfg: TierStoreConfig) -> None:
    if not _is_int(cfg.disk_bytes_per_node):
        raise ConfigError(
            f"disk_bytes_per_node: expected a byte count >= 0, got {cfg.disk_bytes_per_node!r}"
        )
    parse_bytes("disk_bytes_per_node", cfg.disk_bytes_per_node)
    if cfg.disk_bytes_per_node > 0 and not cfg.disk_path:
        raise ConfigError(
            "disk_path: required when disk_bytes_per_node > 0; set it to a directory on "
            "each node's local disk"
        )
    _check_disk_path(cfg.disk_path)
    _check_bool(cfg, "disk_fsync")


def _check_disk_path(path: object) -> None:
    """An absolute path of printable ASCII: every node's NodeStore opens it in its own
    working directory and with its own HOME, where a relative or ``~`` path means
    something else; a NUL fails only there, inside the actor."""
    if path is None:
        return
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"disk_path: expected a directory path, got {path!r}")
    if not path.isascii() or not path.isprintable():
        raise ConfigError(
            "disk_path: expected printable ASCII only (no NUL, control or non-ASCII "
            f"characters), got {path!r}"
        )
    if not path.startswith("/"):
        raise ConfigError(
            f"disk_path: expected an absolute path (starting with '/'; '~' is not expanded), "
            f"got {path!r}"
        )


def _check_policy(cfg: TierStoreConfig) -> None:
    # Imported here, as before the split: importing config does not load the control package.
    from tierstore.control.policies import POLICIES

    if cfg.eviction_policy not in POLICIES.names():
        raise ConfigError(
            f"eviction_policy: unknown policy {cfg.eviction_policy!r}; supported: "
            f"{', '.join(POLICIES.names())}"
        )


def _check_watermarks(cfg: TierStoreConfig) -> None:
    for key in ("cpu_high_watermark", "cpu_low_watermark"):
        value = getattr(cfg, key)
        if not _is_number(value) or not 0 < value <= 1:
            raise ConfigError(f"{key}: expected a fraction in (0, 1], got {value!r}")
    if cfg.cpu_low_watermark > cfg.cpu_high_watermark:
        raise ConfigError(
            f"cpu_low_watermark: {cfg.cpu_low_watermark!r} is above cpu_high_watermark "
            f"{cfg.cpu_high_watermark!r}"
        )


def _check_replication(cfg: TierStoreConfig) -> None:
    if not _is_int(cfg.replicate_after_loads) or cfg.replicate_after_loads < 0:
        raise ConfigError(
            "replicate_after_loads: expected a number of loads >= 0 (0 = never), got "
            f"{cfg.replicate_after_loads!r}"
        )


MAX_PULLS_PER_NODE = 64
PULL_TRANSPORTS = ("object_store", "nixl")


def _check_pulls(cfg: TierStoreConfig) -> None:
    value = cfg.pulls_per_node
    if not _is_int(value) or not 0 <= value <= MAX_PULLS_PER_NODE:
        raise ConfigError(
            f"pulls_per_node: expected a number of pulls from 0 (none at lookup) to "
            f"{MAX_PULLS_PER_NODE}, got {value!r}"
        )
    if cfg.pull_transport not in PULL_TRANSPORTS:
        raise ConfigError(
            f"pull_transport: expected one of {', '.join(map(repr, PULL_TRANSPORTS))}, "
            f"got {cfg.pull_transport!r}"
        )


MAX_EVICTOR_SHARDS = 256
# The "auto" rule's shards per 100 alive nodes: docs/scaling.md, "The default, auto".
_SHARDS_PER_100_NODES = 34


def evictor_shards_for(nodes: int) -> int:
    """The Evictor shards ``evictor_shards: "auto"`` runs on a cluster of ``nodes`` alive
    nodes: 0.34 per node, rounded to the nearest whole number, from 1 to
    :data:`MAX_EVICTOR_SHARDS`.

    The cost model behind 0.34 (docs/scaling.md) is an upper bound, every node at its peak
    asking every key: rounding to nearest rather than up still keeps each shard within its
    core there, and keeps clusters of up to four nodes on one shard, where a second one
    sharing their cores measured slower."""
    return max(1, min(MAX_EVICTOR_SHARDS, (nodes * _SHARDS_PER_100_NODES + 50) // 100))


def _check_shards(cfg: TierStoreConfig) -> None:
    value = cfg.evictor_shards
    if value == AUTO_SHARDS:
        return
    if not _is_int(value) or not 1 <= value <= MAX_EVICTOR_SHARDS:
        raise ConfigError(
            f"evictor_shards: expected a number of shards from 1 to {MAX_EVICTOR_SHARDS}, or "
            f"{AUTO_SHARDS!r} (chosen from the node count when the first shard starts), "
            f"got {value!r}"
        )


def _check_bounce(cfg: TierStoreConfig) -> None:
    value = cfg.pinned_bounce_bytes
    if not _is_int(value) or value < MIN_PINNED_BOUNCE_BYTES:
        raise ConfigError(
            f"pinned_bounce_bytes: expected a byte count of at least {MIN_PINNED_BOUNCE_BYTES} "
            f'(1MiB), got {value!r}; the default is "256MiB"'
        )
    parse_bytes("pinned_bounce_bytes", value, minimum=MIN_PINNED_BOUNCE_BYTES)


def _check_timeouts(cfg: TierStoreConfig) -> None:
    for key in ("lease_ttl_s", "transfer_timeout_s", "lookup_timeout_ms"):
        value = getattr(cfg, key)
        unit, most = ("ms", MAX_DURATION_MS) if key.endswith("_ms") else ("s", MAX_DURATION_S)
        if not _is_number(value) or not 0 < value <= most:  # NaN compares false too
            raise ConfigError(
                f"{key}: expected a positive number of {unit} up to {most:g} (a day), got {value!r}"
            )
    age = cfg.presence_max_age_ms
    if not _is_number(age) or not 0 <= age <= MAX_DURATION_MS:
        raise ConfigError(
            f"presence_max_age_ms: expected ms from 0 (off) to {MAX_DURATION_MS:g} (a day), "
            f"got {age!r}"
        )
    _check_bool(cfg, "hits_from_picture")


# The order of the checks before they were split: a config with several bad values still
# reports the same first one.
_CHECKS: tuple[Callable[[TierStoreConfig], None], ...] = (
    _check_cpu_bytes,
    _check_namespace,
    _check_ray_address,
    _check_disk,
    _check_policy,
    _check_watermarks,
    _check_replication,
    _check_shards,
    _check_timeouts,
    _check_model_identity,
    _check_bounce,
    _check_pulls,
)


# ---- one config per set of actors ---------------------------------------------------------
# The keys that define tierstore's actors: the NodeStores' tiers and the Evictor's policy.
# Actors are named and detached, started by the first engine or `tierstore up`; a later
# config that names other values for these is refused (check_running_config), since no
# actor would apply them. The namespace selects the actors, and the other keys are each
# engine's own (its deadlines, its leases, its Ray address): they may differ freely.
ACTOR_KEYS: tuple[str, ...] = (
    "cpu_bytes_per_node",
    "disk_path",
    "disk_bytes_per_node",
    "disk_fsync",
    "eviction_policy",
    "cpu_high_watermark",
    "cpu_low_watermark",
    "replicate_after_loads",
    "pulls_per_node",
    "pull_transport",
    "evictor_shards",
)
ENGINE_KEYS: tuple[str, ...] = (
    "namespace",
    "ray_address",
    "lease_ttl_s",
    "lookup_timeout_ms",
    "presence_max_age_ms",
    "hits_from_picture",
    "transfer_timeout_s",
    "model_identity",
    "pinned_bounce_bytes",
)


class ConfigMismatchError(ConfigError):
    """Actors already run in this namespace with other values of :data:`ACTOR_KEYS`."""


def check_running_config(mine: TierStoreConfig, running: TierStoreConfig, actor: str) -> None:
    """Raise :class:`ConfigMismatchError` naming every key of :data:`ACTOR_KEYS` whose
    value in ``mine`` differs from the one ``actor`` runs with, both values quoted.
    ``evictor_shards`` ``"auto"`` in ``mine`` matches any running number: its holder
    adopts that number."""
    differing = [
        f"{key}: running {getattr(running, key)!r}, this config {getattr(mine, key)!r}"
        for key in ACTOR_KEYS
        if getattr(mine, key) != getattr(running, key)
        and not (key == "evictor_shards" and mine.evictor_shards == AUTO_SHARDS)
    ]
    if differing:
        raise ConfigMismatchError(
            f"{actor} in namespace {mine.namespace!r} already runs with another config ("
            + "; ".join(differing)
            + "). Give these keys the running values, or stop the actors with `tierstore "
            f"down --namespace {mine.namespace}` first (their CPU tier is dropped), or use "
            "another namespace"
        )
