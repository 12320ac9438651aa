"""Paged KV-cache bookkeeping: the block pool and the per-request block tables.

Host-side only. Block ids index the backends' cache arrays; block 0 is the
null block (never handed out; padded tokens may write into it).

Prefix caching: a full block's hash chains its parent's hash with its token
ids (and extra keys), so equal hashes mean equal whole prefixes. Freed blocks
keep their hash (lazy eviction) and sit in an LRU free queue; a hit takes them
back out, a new allocation evicts from the queue's head. Hits are capped at
`num_tokens - 1` so at least one token is always computed (it yields logits).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from enginecore.config import ConfigError
from enginecore.request import Request

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # token ids of the block when hashed (re-checked on hit, like nano-vllm)
    token_ids: tuple[int, ...] | None = None


def make_hash_fn(algo: str) -> Callable[[bytes | None, tuple[int, ...], tuple], bytes]:
    """hash(parent_hash, token_ids, extra_keys) -> bytes, for the chosen algorithm."""
    if algo in ("sha256", "sha256_cbor"):

        def h(parent, tokens, extra):
            return hashlib.sha256(pickle.dumps((parent, tokens, extra), protocol=5)).digest()

    elif algo == "xxhash":
        import xxhash

        def h(parent, tokens, extra):
            return xxhash.xxh3_128_digest(pickle.dumps((parent, tokens, extra), protocol=5))

    else:

        def h(parent, tokens, extra):
            return hash((parent, tokens, extra)).to_bytes(8, "little", signed=True)

    return h


class BlockPool:
    """Owns every block: ref counts, the LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (1 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # never free
        # LRU order: head is evicted first. Block id -> block.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        blk = self._cached.get(block_hash)
        if blk is None or blk.token_ids != token_ids:
            return None
        return blk

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take hit blocks: bump ref counts, remove from the free queue if idle."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: KVCacheBlock) -> None:
        if b.block_hash is not None:
            if self._cached.get(b.block_hash) is b:
                del self._cached[b.block_hash]
            b.block_hash = None
            b.token_ids = None

    def cache_block(self, b: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or b.block_hash is not None:
            return
        b.block_hash = block_hash
        b.token_ids = token_ids
        self._cached.setdefault(block_hash, b)

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue's tail in the given order."""
        for b in blocks:
            if b is self.null_block:
                continue
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} freed twice"
            if b.ref_cnt == 0:
                if not self.enable_caching:
                    self._evict(b)
                self._free[b.block_id] = b

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_used_blocks != 0:
            return False
        for b in self.blocks[1:]:
            self._evict(b)
        return True

    def check_invariants(self) -> None:
        free_ids = set(self._free)
        assert NULL_BLOCK_ID not in free_ids
        for b in self.blocks[1:]:
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), f"block {b.block_id} ref {b.ref_cnt}"
        assert self.num_free_blocks + self.num_used_blocks == self.num_usable_blocks


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    resets: int = 0


class KVCacheManager:
    """Per-request block tables on top of the pool (vLLM's KVCacheManager)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hash_fn = make_hash_fn(hash_algo)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self.stats = PrefixCacheStats()

    # -- hashing ----------------------------------------------------------------

    def _update_block_hashes(self, req: Request, upto_tokens: int) -> None:
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= upto_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            toks = tuple(req.tokens_slice(i * bs, (i + 1) * bs))
            req.block_hashes.append((self.hash_fn(parent, toks, ()), toks))

    def _can_use_cache(self, req: Request) -> bool:
        return self.enable_caching and req.sampling_params.prompt_logprobs is None

    # -- the manager's API --------------------------------------------------------

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a new request: (blocks, num_tokens). Does not take them."""
        if not self._can_use_cache(req):
            return [], 0
        self._update_block_hashes(req, req.num_tokens)
        # Cap at num_tokens - 1: the last token must be computed to get logits.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for bh, toks in req.block_hashes[:max_blocks]:
            blk = self.pool.get_cached_block(bh, toks)
            if blk is None:
                break
            hits.append(blk)
        self.stats.queries += req.num_tokens
        self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; all or nothing.

        Returns the ids of newly allocated blocks (hit blocks included first), or
        None if the pool cannot supply them (nothing changes then).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        if need <= 0 and not new_computed_blocks:  # the tokens fit in its blocks (most decode steps)
            return []
        # hit blocks that sit idle in the free queue are taken from it too
        idle_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need + idle_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.allocate(max(need, 0))
        blocks = self.req_blocks.setdefault(req.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if new_computed_blocks:
            self.num_cached_blocks[req.request_id] = len(blocks) - len(new_blocks)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in new_blocks]

    def cache_computed_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks whose KV a finished step has written.

        Blocks become prefix-cache hits only after the step that computes them
        (vLLM publishes them when it schedules them). Two things follow: no step
        ever reads a block another request of the same step is writing, so a
        kernel may process requests in any order or in parallel (the Pallas
        kernel's fused write relies on it); and a step that never ran (its
        requests preempted, aborted or failed) leaves no hash on uncomputed KV.
        The price: identical prompts scheduled in the same step do not share.
        """
        if not self._can_use_cache(req):
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        upto = min(num_computed_tokens, req.num_tokens)
        self._update_block_hashes(req, upto)
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = min(upto // self.block_size, len(blocks))
        for i in range(start, end):
            bh, toks = req.block_hashes[i]
            self.pool.cache_block(blocks[i], bh, toks)
        self.num_cached_blocks[req.request_id] = max(start, end)

    def free(self, req: Request) -> None:
        """Release a request's blocks, tail first, so a prefix's tail is evicted before its head."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            self.stats.resets += 1
        return ok

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def check_invariants(self, live_request_ids: set[str] | None = None) -> None:
        self.pool.check_invariants()
        if live_request_ids is not None:
            stray = set(self.req_blocks) - live_request_ids
            assert not stray, f"blocks held by finished requests: {sorted(stray)}"
        owned = sum(len(v) for v in self.req_blocks.values())
        # shared (prefix-hit) blocks are counted once per owner
        refs = sum(b.ref_cnt for b in self.pool.blocks[1:])
        assert owned == refs, f"block refs {refs} != blocks held by requests {owned}"


# -- sizing: how many blocks a memory budget holds (one policy for both backends) -----------

DEFAULT_CPU_KV_BYTES = 1 << 30


def available_memory_bytes() -> int | None:
    """The host's MemAvailable, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_cpu_kv_bytes() -> int:
    """The CPU KV budget when --kv-cache-memory-bytes is not given: 1 GiB, or a quarter of the available
    memory if that is less."""
    avail = available_memory_bytes()
    return DEFAULT_CPU_KV_BYTES if avail is None else min(DEFAULT_CPU_KV_BYTES, avail // 4)


def check_cpu_kv_fits(nbytes: int) -> None:
    """A CPU KV cache that the OS hands out page by page (not all committed at start: as a background thread
    commits it, `cpu_kernels.memory.populate_in_background`, or steps first write it) must still fit the memory
    available now: otherwise the start fails here, with the flag to change, instead
    of the process being killed for memory mid-serve once enough blocks are in use."""
    avail = available_memory_bytes()
    if avail is not None and nbytes > avail:
        raise ConfigError(f"the KV cache needs {nbytes / 2**30:.2f} GiB but this host has {avail / 2**30:.2f} GiB "
                          f"available; lower --kv-cache-memory-bytes (or --max-num-seqs / --max-model-len)")


def num_kv_blocks(budget_bytes: int, bytes_per_block: int, max_num_seqs: int, max_model_len: int,
                  block_size: int, what: str) -> int:
    """Blocks that fit `budget_bytes` (`what` names the flag that set it), capped at what the scheduler can
    ever use (every sequence at max_model_len, plus the null block). Fewer than one max_model_len sequence
    needs is an error that says which flag to change."""
    per_seq = -(-max_model_len // block_size)
    n = int(budget_bytes // bytes_per_block)
    if n < per_seq + 1:
        raise ConfigError(
            f"{what} holds {n} KV blocks of {bytes_per_block} bytes, fewer than the {per_seq + 1} one "
            f"--max-model-len {max_model_len} sequence needs; lower --max-model-len or give the KV cache more memory"
        )
    return min(n, max_num_seqs * per_seq + 1)


def kv_blocks_for(config, bytes_per_block: int, block_size: int, device_budget=None) -> int:
    """The KV cache's blocks, both backends' one policy: --kv-cache-memory-bytes if given; else on an
    accelerator `device_budget()` -> (bytes, what set them: the flag, for the message) - what its memory
    leaves after the weights and a step's peak; else (a CPU, `device_budget` None) `default_cpu_kv_bytes()`.
    Then `num_kv_blocks`."""
    cc, sc = config.cache_config, config.scheduler_config
    if cc.kv_cache_memory_bytes is not None:
        budget, what = cc.kv_cache_memory_bytes, f"--kv-cache-memory-bytes {cc.kv_cache_memory_bytes}"
    elif device_budget is None:
        budget, what = default_cpu_kv_bytes(), "the default CPU KV cache (min(1 GiB, MemAvailable / 4))"
    else:
        budget, what = device_budget()
    return num_kv_blocks(budget, bytes_per_block, sc.max_num_seqs, sc.max_model_len, block_size, what)
