"""A deterministic stand-in for a backend, for scheduler tests.

It consumes the real `InputBatch`/`StepBatch` and "computes" the next token as
a hash of the whole token history, so any schedule (chunked, preempted,
prefix-cached, asynchronous) must give the same tokens as a plain run. It also
checks the batch contract (tokens land in the request's own blocks, positions
are contiguous, padding is inert) and, like a device, keeps the newest sampled
token of each row itself: a step launched before the previous one's result
was collected reads it from there (`input_from_row`), as the real runners do.
"""

from __future__ import annotations

import numpy as np

from enginecore.buckets import Buckets
from enginecore.input_batch import InputBatch
from enginecore.runner_output import DoneStep, empty_output, finish_step
from enginecore.step_batch import prepare_step


class _Handle:
    def __init__(self, fn):
        self._fn = fn

    def result(self):
        return self._fn()


class FakeRunner:
    def __init__(self, config, vocab_size: int = 1000, num_blocks: int = 64):
        self.config = config
        self.vocab_size = vocab_size
        self._num_blocks = num_blocks
        sc, cc = config.scheduler_config, config.cache_config
        self.block_size = cc.block_size
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_model_len, cc.block_size, vocab_size)
        self.buckets = Buckets.create(sc.max_num_batched_tokens, sc.max_num_seqs, 1, 1)
        self.kv: dict[int, int] = {}  # slot -> token id written there
        self.last_token: dict[int, int] = {}  # row -> newest sampled token ("on the device")
        self.steps = 0
        self.pending = 0  # launched steps whose result was not collected yet

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

    def execute(self, so):
        ib = self.input_batch
        ib.update(so)
        if so.total_num_scheduled_tokens == 0:
            return DoneStep(empty_output())
        b = prepare_step(ib, so, self.buckets)
        self.steps += 1
        T, R = b.num_tokens, b.num_reqs
        assert b.padded_num_tokens >= T and b.padded_num_reqs >= R
        assert b.cu_q_lens[0] == 0 and (np.diff(b.cu_q_lens) >= 0).all() and (b.cu_q_lens[R:] == T).all()
        assert (b.kv_lens[R:] == 0).all() and (b.sample_rows[R:] == -1).all()
        # requests decode-only (one token), prefill-only (nothing cached before), mixed, in that order
        q = np.diff(b.cu_q_lens[: R + 1])
        cached = b.kv_lens[:R] - q
        cls = np.where(q == 1, 0, np.where(cached == 0, 1, 2))
        assert (q >= 1).all() and (np.diff(cls) >= 0).all(), "requests out of the decode/prefill/mixed order"
        assert b.distribution.tolist() == [int((cls == 0).sum()), int((cls <= 1).sum()), R]
        assert (b.logits_indices[:R] == b.cu_q_lens[1 : R + 1] - 1).all()
        assert (b.input_ids[T:] == 0).all() and (b.input_from_row[T:] == -1).all() and (b.positions[T:] == 0).all()
        assert (b.block_tables[R:] == 0).all()
        samples = np.flatnonzero(b.sample_rows[:R] >= 0)
        assert (b.sample_index == samples).all() and (b.sample_rows[samples] == b.rows[samples]).all()
        sampled = np.zeros(b.padded_num_reqs, np.int32)
        for i in range(R):
            s, e = b.cu_q_lens[i], b.cu_q_lens[i + 1]
            row = int(b.rows[i])
            assert ib.req_row[b.req_ids[i]] == row
            nb = ib.num_blocks[row]
            own = set(ib.block_table[row, :nb].tolist())
            assert (b.positions[s:e] == np.arange(cached[i], b.kv_lens[i])).all()
            for t in range(s, e):
                pos = int(b.positions[t])
                blk = int(b.block_tables[i, pos // self.block_size])
                assert blk in own, "token outside the request's blocks"
                assert blk != 0, "wrote into the null block"
                src = int(b.input_from_row[t])
                tok = self.last_token[src] if src >= 0 else int(b.input_ids[t])
                if src >= 0:
                    assert src == row and t == e - 1, "only a request's newest token comes from the device"
                self.kv[blk * self.block_size + pos % self.block_size] = tok
            # read back the whole history through the block table: the KV "cache"
            kv_len = int(b.kv_lens[i])
            h = 0
            for p in range(kv_len):
                blk = int(b.block_tables[i, p // self.block_size])
                h = (h * 1000003 + self.kv[blk * self.block_size + p % self.block_size] + 1) % (2**61 - 1)
            sampled[i] = h % self.vocab_size
            if b.sample_rows[i] >= 0:
                self.last_token[row] = int(sampled[i])
        self.pending += 1

        def collect():
            self.pending -= 1
            return finish_step(ib, b, sampled)

        return _Handle(collect)
