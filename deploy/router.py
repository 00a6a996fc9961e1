"""A Ray Serve request router that sees tierstore's tiers: :class:`TierAwareRouter`.

Ray's routers rank replicas by queue length (``PowerOfTwoChoicesRequestRouter``), by
the prompts they were sent (``PrefixCacheAffinityRouter``) or by the device caches the
engines publish (``KVAwareRouter``, which drops offloaded events whose locality is
REMOTE). None sees what tierstore holds off the GPU, on which node. This one ranks the
candidate replicas of a request by, in order:

1. the longest prefix of the request resident in the replica's device cache, as this
   router saw it: the block hashes of the prompts it routed to that replica, at most
   ``device_blocks`` per replica, least recently routed forgotten first (an
   approximation, as ``PrefixCacheAffinityRouter``'s prefix tree of routed prompts is:
   the engines' own KV events need a ZMQ subscription to every replica's engine, which
   Ray Serve LLM wires up only for its ``KVAwareRouter``);
2. the longest prefix tierstore holds on the replica's own node (its CPU or disk tier,
   every rank, every KV cache group): loaded there without crossing the network, where
   a prefix held only on another node crosses once (the same for every replica off that
   node);
3. then load: the replicas of the best rank go to Ray's queue-length choice (the one
   with the shortest queue that accepts), the next rank only if none of them accepts.

Keys are vLLM's: the router computes the prompt's block hashes with vLLM's own
``hash_block_tokens`` and the engines' hash (``sha256``, the default; the ``xxhash``
variants are seeded per process and never match: README, "Hash seeds"; set one
``PYTHONHASHSEED`` for the router and the engines, or none), at ``block_size`` tokens per
hash, and each KV cache group's offload keys every ``kv_groups[g]`` hashes (vLLM's
``make_offload_key``), as vLLM's offloading scheduler does. A prefix counts only up to
the first boundary where some group's chunk is missing. A request with LoRA,
``cache_salt`` or multimodal items has other block hashes (vLLM hashes those in): it
finds nothing and is routed by load.

tierstore is asked once per request: one :meth:`EvictorClient.holders` call to the
Evictor shard of the request's root (read-only: no lease, no pull), awaited on the
router's event loop for at most ``index_timeout_s``. When it times out or fails, the
request is routed as Ray's default router routes it (power of two choices on queue
length). Prompt token ids come from the request: a ``request_token_ids`` keyword, or a
first argument (a dict or an object, as Ray Serve LLM's OpenAI requests) whose
``prompt_token_ids`` or ``prompt`` is a list of token ids; with ``tokenizer`` (a Hugging
Face name or path), a text ``prompt`` or chat ``messages`` are tokenized here (the chat
template with the generation prompt, as vLLM renders it by default).

Use it in a deployment's ``request_router_config``::

    RequestRouterConfig(
        request_router_class="tierstore.deploy.router:TierAwareRouter",
        request_router_kwargs={"namespace": NS, "block_size": 16, "tokenizer": MODEL},
    )

``namespace`` is the engines' tierstore namespace (each engine logs ``tierstore manager:
namespace ...`` when it starts).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeGuard

import ray
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)
from tierstore.actors.clients import EvictorClient
from tierstore.actors.names import evictor_name

from tierstore.config import AUTO_SHARDS
from tierstore.keys import ChunkKey, Namespace, NodeId, root_of, shard_of
from tierstore.wire import config_of, holders_of

logger = logging.getLogger(__name__)

# The keyword Ray Serve LLM's ingress passes a request's prompt token ids under.
REQUEST_TOKEN_IDS_KWARG = "request_token_ids"
# Requests whose keys are kept between choose_replicas and on_request_routed.
_PENDING_KEPT = 4096


class PromptKeys:
    """One prompt's block hashes and tierstore keys (vLLM's ``OffloadKey`` bytes)."""

    def __init__(
        self, hashes: list[bytes], keys: list[tuple[int, ChunkKey]], step: int, block_size: int
    ) -> None:
        self.hashes = hashes  # one per ``block_size`` tokens, chained
        self.keys = keys  # (hashes it ends at, key), sorted by end
        self.step = step  # hashes per boundary at which every group's chunk ends
        self.block_size = block_size

    def prefix_tokens(self, present: Callable[[int, ChunkKey], bool]) -> int:
        """Tokens of the longest prefix whose every key ending within it is present
        (``present(i, key)``, ``i`` the key's place in :attr:`keys`), ending where every
        KV cache group's chunk ends."""
        covered = len(self.hashes)
        for i, (end, key) in enumerate(self.keys):
            if not present(i, key):
                covered = end - 1
                break
        return (covered // self.step) * self.step * self.block_size


class KeyMaker:
    """vLLM's block hashes and offload keys of a prompt, computed with vLLM's own
    functions (``hash_block_tokens``, ``make_offload_key``) and the engines' hash.

    ``block_size``: tokens per hash (vLLM's hash block size: the block size, for a
    hybrid model its smallest group block size). ``kv_groups``: per KV cache group (by
    index), hashes per offloaded chunk (``block_size_of_group * blocks_per_chunk //
    block_size``). Imports vLLM when made."""

    def __init__(self, block_size: int, kv_groups: Sequence[int], hash_name: str = "sha256"):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.kv_offload.base import make_offload_key

        if block_size < 1 or not kv_groups or min(kv_groups) < 1:
            raise ValueError(f"block_size {block_size!r}, kv_groups {list(kv_groups)!r}")
        self.block_size = block_size
        self.kv_groups = list(kv_groups)
        self._hash = get_hash_fn_by_name(hash_name)
        self._hash_tokens = kv_cache_utils.hash_block_tokens
        self._make_key = make_offload_key
        # vLLM's NONE_HASH (the chain's root) without touching vLLM's global: the same
        # seed rule as its init_none_hash (PYTHONHASHSEED, else a fixed seed for sha256).
        seed = kv_cache_utils.resolve_none_hash_seed(self._hash)
        self._none_hash = kv_cache_utils.BlockHash(self._hash(seed))
        self.step = math.lcm(*self.kv_groups)

    def __call__(self, token_ids: Sequence[int]) -> PromptKeys:
        hashes: list[bytes] = []
        parent = self._none_hash
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = self._hash_tokens(
                self._hash, parent, token_ids[start : start + self.block_size], None
            )
            hashes.append(parent)
        keys = sorted(
            (end, ChunkKey(self._make_key(hashes[end - 1], group)))
            for group, per_chunk in enumerate(self.kv_groups)
            for end in range(per_chunk, len(hashes) + 1, per_chunk)
        )
        return PromptKeys(hashes, keys, self.step, self.block_size)


class DeviceRecord:
    """What this router routed to one replica: block hashes, least recently routed
    forgotten first beyond ``capacity``. Stands for the replica's device prefix cache."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def prefix_tokens(self, prompt: PromptKeys) -> int:
        n = 0
        for h in prompt.hashes:
            if h not in self._hashes:
                break
            n += 1
        return n * prompt.block_size

    def add(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self._capacity:
            self._hashes.popitem(last=False)


class TierAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ranks replicas by device prefix, then tierstore's same-node prefix, then load
    (module docstring). Runs on the handle's event loop: nothing here blocks it on Ray
    (the index call and the Evictor's handle lookup are awaited with deadlines)."""

    def initialize_state(  # type: ignore[override]  # noqa: PLR0913 - request_router_kwargs
        self,
        namespace: str = "",
        block_size: int = 16,
        kv_groups: Sequence[int] = (1,),
        world_size: int = 1,
        ray_namespace: str = "tierstore",
        evictor_shards: int | Literal["auto"] = AUTO_SHARDS,
        index_timeout_s: float = 0.05,
        device_blocks: int = 100_000,
        tokenizer: str | None = None,
        hash_name: str = "sha256",
    ) -> None:
        """``namespace``: the engines' tierstore namespace (digest). ``ray_namespace``
        and ``evictor_shards``: tierstore's ``namespace`` and ``evictor_shards`` keys
        (``"auto"``: the number Evictor shard 0 runs with, asked with the first index
        call and again after one fails).
        ``world_size``: the engines' ranks (TP x PP): a chunk is held where every rank
        is. ``index_timeout_s``: the longest a request waits for tierstore's answer.
        Raises ValueError for a bad block size, group list or shard count."""
        if not namespace:
            raise ValueError("TierAwareRouter needs the engines' tierstore namespace")
        self._namespace = Namespace(namespace)
        self._keys_of = KeyMaker(block_size, kv_groups, hash_name)
        self._world_size = world_size
        self._ray_namespace = ray_namespace
        if not isinstance(evictor_shards, int) and evictor_shards != AUTO_SHARDS:
            raise ValueError(f"evictor_shards: expected a number or 'auto', got {evictor_shards!r}")
        self._auto_shards = not isinstance(evictor_shards, int)
        self._shards: int | None = evictor_shards if isinstance(evictor_shards, int) else None
        self._timeout_s = index_timeout_s
        self._device_blocks = device_blocks
        self._devices: dict[ReplicaID, DeviceRecord] = {}
        self._evictors: dict[int, EvictorClient] = {}
        self._pending: OrderedDict[str, PromptKeys] = OrderedDict()
        self._tokenizer: Any = None
        if tokenizer is not None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        # Requests ranked with tierstore's answer; routed by Ray's default instead
        # (the index call timed out or failed); with no token ids to rank on.
        self.stats = {"ranked": 0, "fallbacks": 0, "no_tokens": 0}

    # ---- the ranking ---------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        prompt = await self._prompt_keys(pending_request) if pending_request else None
        if prompt is None or not candidate_replicas or pending_request is None:
            self.stats["no_tokens"] += prompt is None
            return await self._default(candidate_replicas, pending_request)
        if pending_request.metadata.multiplexed_model_id:
            return await self._default(candidate_replicas, pending_request)
        held = await self._holders(prompt) if prompt.keys else []
        if held is None:
            self.stats["fallbacks"] += 1
            return await self._default(candidate_replicas, pending_request)
        self.stats["ranked"] += 1
        scores: dict[tuple[int, int], list[RunningReplica]] = {}
        for replica in candidate_replicas:
            device = self._devices.get(replica.replica_id)
            on_device = device.prefix_tokens(prompt) if device else 0
            node = NodeId(replica.node_id or "")
            here = prompt.prefix_tokens(_held_on(node, held))
            scores.setdefault((on_device, here), []).append(replica)
        return [scores[score] for score in sorted(scores, reverse=True)]

    async def _default(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Ray's default router's choice (power of two choices on queue length)."""
        chosen: list[list[RunningReplica]] = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # type: ignore[arg-type]  # it only uses the mixins this class has too
            candidate_replicas=candidates,
            pending_request=pending_request,
        )
        return chosen

    async def _holders(self, prompt: PromptKeys) -> list[frozenset[NodeId]] | None:
        """Per key of ``prompt``, the nodes holding it: one call to the Evictor shard of
        the prompt's root, at most ``index_timeout_s``; None when it failed or was late."""
        first = prompt.keys[0][1]
        shard = 0  # shard 0 is asked for the shard count until it is known
        try:
            async with asyncio.timeout(self._timeout_s):
                shard = shard_of(root_of(self._namespace, first), await self._shard_count())
                evictor = await self._evictor(shard)
                pending = evictor.holders(
                    self._namespace, [key for _, key in prompt.keys], self._world_size
                )
                value = await asyncio.wrap_future(pending.ref.future())
            return holders_of(value)
        except Exception as exc:  # a timeout, a missing or failing Evictor: Ray's default
            logger.warning("tierstore's index did not answer (%r): routing by load", exc)
            # Its handle is looked up again next time: a restarted Evictor is a new actor.
            # So is an "auto" shard count: actors started again may run another one.
            self._evictors.pop(shard, None)
            if self._auto_shards:
                self._shards = None
            return None

    async def _shard_count(self) -> int:
        """The Evictor shards: as given, else (``"auto"``) shard 0's running number,
        asked once after each failed index call (raises as :meth:`_evictor` and the
        call do)."""
        if self._shards is None:
            pending = (await self._evictor(0)).config()
            self._shards = config_of(await asyncio.wrap_future(pending.ref.future())).shard_count
        return self._shards

    async def _evictor(self, shard: int) -> EvictorClient:
        """Evictor shard ``shard``'s client, its handle looked up in Ray's GCS once, on a
        thread (raises ValueError while it does not run)."""
        client = self._evictors.get(shard)
        if client is None:
            handle = await asyncio.to_thread(
                ray.get_actor, evictor_name(shard), namespace=self._ray_namespace
            )
            client = self._evictors[shard] = EvictorClient(handle, self._timeout_s)
        return client

    # ---- the prompt ----------------------------------------------------------------
    async def _prompt_keys(self, pending_request: PendingRequest) -> PromptKeys | None:
        request_id = pending_request.metadata.internal_request_id
        prompt = self._pending.get(request_id)
        if prompt is not None:
            return prompt
        token_ids = self._token_ids(pending_request)
        if token_ids is None and self._tokenizer is not None:
            token_ids = await asyncio.to_thread(self._tokenize, pending_request)
        if token_ids is None:
            return None
        prompt = await asyncio.to_thread(self._keys_of, token_ids)
        self._pending[request_id] = prompt
        while len(self._pending) > _PENDING_KEPT:
            self._pending.popitem(last=False)
        return prompt

    @staticmethod
    def _token_ids(pending_request: PendingRequest) -> list[int] | None:
        ids = pending_request.kwargs.get(REQUEST_TOKEN_IDS_KWARG)
        if _is_token_ids(ids):
            return list(ids)
        for arg in pending_request.args[:1]:
            for name in ("prompt_token_ids", "prompt"):
                value = _field(arg, name)
                if _is_token_ids(value):
                    return list(value)
        return None

    def _tokenize(self, pending_request: PendingRequest) -> list[int] | None:
        """A text prompt's or chat's token ids, with this router's tokenizer (a thread)."""
        for arg in pending_request.args[:1]:
            prompt = _field(arg, "prompt")
            if isinstance(prompt, str):
                return list(self._tokenizer.encode(prompt))
            messages = _field(arg, "messages")
            if isinstance(messages, list):
                plain = [m if isinstance(m, dict) else m.model_dump() for m in messages]
                ids = self._tokenizer.apply_chat_template(
                    plain, add_generation_prompt=True, tokenize=True
                )
                return list(ids)
        return None

    # ---- what the router saw -------------------------------------------------------
    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        prompt = self._pending.pop(pending_request.metadata.internal_request_id, None)
        if prompt is None:
            return
        record = self._devices.get(replica_id)
        if record is None:
            record = self._devices[replica_id] = DeviceRecord(self._device_blocks)
        record.add(prompt.hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._devices.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in set(self._devices) - set(self._replica_id_set):
            del self._devices[gone]


def _field(arg: Any, name: str) -> Any:
    return arg.get(name) if isinstance(arg, dict) else getattr(arg, name, None)


def _held_on(node: NodeId, held: list[frozenset[NodeId]]) -> Callable[[int, ChunkKey], bool]:
    """Whether ``node`` holds the ``i``-th key (``held``: the index's answer)."""
    return lambda i, _key: node in held[i]


def _is_token_ids(value: Any) -> TypeGuard[Sequence[int]]:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
