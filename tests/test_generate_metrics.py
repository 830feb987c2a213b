"""Generate's metrics, scraped from a real worker's /metrics: time to first token and
between tokens (histograms, per model), tokens generated and finish reasons (counters)."""

from __future__ import annotations

import time

from tests.test_generate import PARAMS, PROMPT
from tests.test_observability import scrape, value


def test_generation_metrics_count_tokens_latencies_and_finish_reasons(start_worker):
    w = start_worker(metrics_listen="127.0.0.1:0")
    c = w.client
    before = scrape(w)
    sid = c.create_session("lm").session_id
    got = list(c.generate(sid, 25, prompt_ids=PROMPT, **PARAMS))
    other = c.create_session("lm").session_id
    stop_at = got[3].token_id  # a stop id drawn as the 4th token at the latest
    stopped = list(c.generate(other, 25, prompt_ids=PROMPT, stop_token_ids=[stop_at], **PARAMS))
    for _token in c.generate(sid, 50, **PARAMS):  # broken off: the client went away
        break
    aborted = ("ssmserve_generations_finished_total", {"model": "lm", "reason": "aborted"})
    deadline = time.monotonic() + 10  # the worker counts it once it sees the cancel
    while value(after := scrape(w), aborted[0], **aborted[1]) == 0:
        assert time.monotonic() < deadline, "the broken-off call was never counted"
        time.sleep(0.05)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    sent = len(got) + len(stopped) + 1
    assert delta("ssmserve_generation_tokens_total", model="lm") >= sent
    assert delta("ssmserve_generations_finished_total", model="lm", reason="length") == 1
    assert delta("ssmserve_generations_finished_total", model="lm", reason="stop") == 1
    assert delta("ssmserve_generations_finished_total", model="lm", reason="aborted") == 1
    assert delta("ssmserve_time_to_first_token_seconds_count", model="lm") == 3
    firsts = delta("ssmserve_time_to_first_token_seconds_sum", model="lm")
    assert 0 < firsts < 30
    # every token after a call's first is one gap between tokens
    gaps = delta("ssmserve_inter_token_latency_seconds_count", model="lm")
    assert gaps == delta("ssmserve_generation_tokens_total", model="lm") - 3
    assert delta("ssmserve_inter_token_latency_seconds_bucket", model="lm", le="30.0") == gaps
    assert delta("ssmserve_time_to_first_token_seconds_bucket", model="lm", le="0.001") <= 3
