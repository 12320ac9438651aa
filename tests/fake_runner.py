"""A deterministic stand-in for a backend, for scheduler tests.

It consumes the real `InputBatch`/`StepBatch` and "computes" the next token as
a hash of the whole token history, so any schedule (chunked, preempted,
prefix-cached) must give the same tokens as a plain run. It also checks the
batch contract (slots point into the request's own blocks, positions are
contiguous, padding is inert).
"""

from __future__ import annotations

import numpy as np

from enginecore.batch import InputBatch, make_runner_output
from enginecore.outputs import ModelRunnerOutput


class FakeRunner:
    def __init__(self, config, vocab_size: int = 1000, num_blocks: int = 64):
        self.config = config
        self.vocab_size = vocab_size
        self._num_blocks = num_blocks
        sc, cc = config.scheduler_config, config.cache_config
        self.block_size = cc.block_size
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_model_len, sc.max_num_batched_tokens,
                                      cc.block_size, vocab_size)
        self.kv: dict[int, int] = {}  # slot -> token id written there
        self.steps = 0

    def load_model(self):
        pass

    def determine_num_blocks(self):
        return self._num_blocks

    def init_kv_cache(self, n):
        self._num_blocks = n

    def warmup(self):
        return {}

    def shutdown(self):
        pass

    def execute(self, so) -> ModelRunnerOutput:
        ib = self.input_batch
        ib.update(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        b = ib.prepare(so)
        self.steps += 1
        T, R = b.num_tokens, b.num_reqs
        assert b.padded_num_tokens >= T and b.padded_num_reqs >= R
        assert (b.slot_mapping[T:] == -1).all()
        assert b.cu_q_lens[0] == 0 and (np.diff(b.cu_q_lens) >= 0).all()
        d = b.distribution
        assert d[0] <= d[1] <= d[2] == R
        sampled = np.zeros(b.padded_num_reqs, np.int32)
        for i in range(R):
            s, e = b.cu_q_lens[i], b.cu_q_lens[i + 1]
            row = ib.req_row[b.req_ids[i]]
            nb = ib.num_blocks[row]
            own = set(ib.block_table[row, :nb].tolist())
            for t in range(s, e):
                pos = int(b.positions[t])
                slot = int(b.slot_mapping[t])
                assert slot // self.block_size in own, "slot outside the request's blocks"
                assert slot // self.block_size != 0, "wrote into the null block"
                self.kv[slot] = int(b.input_ids[t])
            # read back the whole history through the block table: the KV "cache"
            kv_len = int(b.kv_lens[i])
            hist = []
            for p in range(kv_len):
                blk = int(b.block_tables[i, p // self.block_size])
                hist.append(self.kv[blk * self.block_size + p % self.block_size])
            h = 0
            for tok in hist:
                h = (h * 1000003 + tok + 1) % (2**61 - 1)
            sampled[i] = h % self.vocab_size
        return make_runner_output(b, sampled)
