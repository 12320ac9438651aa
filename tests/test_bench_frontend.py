"""benchmarks/bench_frontend.py against real servers: --stream-interval bounds a stream's SSE events."""

from __future__ import annotations

import json


def test_bench_frontend_streams_every_token_in_fewer_events(tiny_model_dir, tmp_path):
    from benchmarks.bench_frontend import main

    out = tmp_path / "r.json"
    assert main(["--model", tiny_model_dir("llama"), "--concurrency", "4", "--stream-interval", "1,4",
                 "--requests-per-level", "2", "--output-len", "9", "--json", str(out), "--log-dir", str(tmp_path)]) == 0
    r = json.loads(out.read_text())
    for si in ("1", "4"):  # (bench_frontend itself checks every request's usage: 9 tokens)
        assert r[si]["4"]["tokens"] == 8 * 9 and r[si]["4"]["api_ms_tok"] > 0
    # --stream-interval 4: the first token, then 4 at a time, the end at once: at most 3 events for 9 tokens
    assert 8 <= r["4"]["4"]["events"] <= 8 * 3
