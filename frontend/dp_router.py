"""Which data-parallel engine core a request goes to (`--data-parallel-size N` behind one API server).

Least loaded: a core's load is its running + waiting requests from its latest stats, plus the requests sent to
it since those stats (they were not counted yet). With prefix caching on, prefix affinity: the prompt's full
blocks are hashed here with the engine's own block hashing (`enginecore.kv_cache.make_hash_fn`, the same chain
the block pool keys its cache by) and a bounded LRU map of recent block hashes -> core says where the longest
known prefix went; the request goes there unless that core is more than `imbalance` requests busier than the
least-loaded one. Pure Python, no sockets: the engine client calls it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from enginecore.kv_cache import KVCacheManager, make_hash_fn
from enginecore.scheduler import SchedulerStats

_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerStats))


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The cores' stats as one engine's: counts summed, KV-cache usage over all their blocks."""
    if len(stats) == 1:
        return stats[0]
    total = SchedulerStats(**{f: sum(getattr(s, f) for s in stats) for f in _STATS_FIELDS})
    total.kv_cache_usage = (total.num_used_blocks / total.num_total_blocks if total.num_total_blocks
                            else sum(s.kv_cache_usage for s in stats) / max(len(stats), 1))
    return total


class _Prompt:
    """What `KVCacheManager._update_block_hashes` reads of a request: its tokens and its hashes so far."""

    __slots__ = ("prompt_token_ids", "block_hashes")

    def __init__(self, prompt_token_ids):
        self.prompt_token_ids = list(prompt_token_ids)
        self.block_hashes: list = []

    def tokens_slice(self, start: int, end: int) -> list[int]:
        return self.prompt_token_ids[start:end]


class DPRouter:
    def __init__(self, num_engines: int, block_size: int = 16, prefix_caching: bool = False,
                 hash_algo: str = "sha256", max_blocks: int = 1 << 16, imbalance: int = 8):
        if num_engines < 1:
            raise ValueError("a router needs at least one engine core")
        self.num_engines = num_engines
        self.block_size = block_size
        self.prefix_caching = prefix_caching and num_engines > 1
        self.hash_fn = make_hash_fn(hash_algo)
        self.max_blocks = max_blocks
        self.imbalance = imbalance
        self.reported = [0] * num_engines  # running + waiting in each core's latest stats
        self.sent = [0] * num_engines  # requests sent to each core since its latest stats
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # block hash -> core, least recently used first

    def load(self, engine: int) -> int:
        return self.reported[engine] + self.sent[engine]

    def on_stats(self, engine: int, stats: SchedulerStats) -> None:
        self.reported[engine] = stats.num_running_reqs + stats.num_waiting_reqs
        self.sent[engine] = 0

    def block_hashes(self, prompt_token_ids) -> list[bytes]:
        """The chained hashes of the prompt's blocks that a core could serve from its cache (as the block pool's
        hits: full blocks, the last token never), by the engine's own hashing of a request's blocks."""
        prompt = _Prompt(prompt_token_ids)
        KVCacheManager._update_block_hashes(self, prompt, ((len(prompt.prompt_token_ids) - 1) // self.block_size)
                                            * self.block_size)
        return [h for h, _ in prompt.block_hashes]

    def choose(self, prompt_token_ids) -> int:
        """The core for a new request; counts it as sent there and remembers where its blocks went."""
        n = self.num_engines
        if n == 1:
            self.sent[0] += 1
            return 0
        loads = [self.reported[e] + self.sent[e] for e in range(n)]
        least = min(range(n), key=loads.__getitem__)
        engine = least
        hashes = self.block_hashes(prompt_token_ids) if self.prefix_caching else []
        for h in reversed(hashes):  # the longest prefix a core has (or is computing)
            owner = self.blocks.get(h)
            if owner is not None:
                if loads[owner] - loads[least] <= self.imbalance:
                    engine = owner
                break
        self.sent[engine] += 1
        blocks = self.blocks
        for h in hashes:
            blocks[h] = engine
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        return engine
