"""Concurrent mixed calls over streamable HTTP on 127.0.0.1 (see _rel_load.py; the full 200 are in benchmarks/reliability.py)."""

from __future__ import annotations

import anyio
from _rel_common import rss_mb
from _rel_load import big_log, call_mix, cheap_while_searching, expected_answers, median, run_load

CI_CALLS = 60
CI_BIG_LOGS = 2


def test_the_big_log_is_a_real_megatron_log_of_10_mb():
    text = big_log()
    assert 10 * 2**20 <= len(text) < 10 * 2**20 + 1000
    assert text.startswith("------------------------ arguments ------------------------")
    assert "iteration        1/" in text and "elapsed time per iteration (ms)" in text.splitlines()[-1]


def test_concurrent_mixed_calls_all_answer_as_they_do_alone(http_server):
    url, pid = http_server
    calls = call_mix(CI_CALLS, CI_BIG_LOGS, big_log())
    expected = anyio.run(expected_answers, url, calls)
    assert None not in expected.values()  # every kind of call succeeds on its own
    rss_before = rss_mb(pid)
    report = anyio.run(run_load, url, calls, expected)
    rss_after = rss_mb(pid)
    print(f"\n{report.requests} requests, {len(report.failures)} failures, p50 {report.pct(0.5):.2f} s, "
          f"p99 {report.pct(0.99):.2f} s, wall {report.wall_s:.1f} s, server RSS {rss_before:.0f} -> {rss_after:.0f} MB")
    assert report.failures == []
    assert len(report.latencies_s) == CI_CALLS
    assert rss_after - rss_before < 1024  # the 3.2 GB growth of the hostile-input probe must not come back


def test_a_cheap_call_stays_fast_while_searches_run(http_server):
    """Depends on the server running CPU-heavy tools off the event loop with a bound on concurrent
    searches (server/app.py `Runner`, issue 18): without it the cheap call waits for the searches."""
    url, _ = http_server
    alone, during = anyio.run(cheap_while_searching, url)
    print(f"\nevaluate_plan median alone {median(alone) * 1000:.0f} ms, during 3 searches {median(during) * 1000:.0f} ms")
    # A search costs ~3 s of CPU; a cheap call queued behind three of them would take 5-10 s.
    assert median(during) < max(1.0, 10 * median(alone))
