"""The prefix cache's bookkeeping (``http.prefix_cache``); its exactness is served in
``test_http_api``."""

from __future__ import annotations

import numpy as np

from ssmserve.server.http.prefix_cache import PrefixCache, common_prefix

KEY = ("tenant-a", "chat")


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, np.int64)


def test_common_prefix():
    assert common_prefix(ids(1, 2, 3), ids(1, 2, 4, 5)) == 2
    assert common_prefix(ids(1, 2), ids(1, 2, 3)) == 2
    assert common_prefix(ids(7), ids(1)) == 0
    assert common_prefix(ids(), ids(1)) == 0


def test_a_whole_history_is_continued_a_longer_shared_one_forked():
    cache = PrefixCache(4, lambda _: None)
    cache.keep(KEY, "short", ids(*range(10)))
    cache.keep(KEY, "long", ids(*range(20), 99))
    prompt = ids(*range(25))
    found = cache.match(KEY, prompt, min_fork=4)
    assert found is not None and found.kept.session_id == "long" and not found.whole
    assert found.length == 20  # 10 more than "short" gives, past min_fork: a fork
    found = cache.match(KEY, prompt, min_fork=16)
    assert found is not None and found.kept.session_id == "short" and found.whole
    assert cache.match(KEY, ids(5, 6), min_fork=1) is None
    assert cache.match(("tenant-b", "chat"), prompt, min_fork=1) is None  # its own only
    # a prompt that ends inside a kept history: a fork at its length
    found = cache.match(KEY, ids(*range(15)), min_fork=4)
    assert found is not None and found.kept.session_id == "long" and found.length == 15


def test_the_least_recent_is_evicted_and_taken_ones_are_not_found():
    evicted: list[str] = []
    cache = PrefixCache(2, evicted.append)
    cache.keep(KEY, "a", ids(1, 2))
    cache.keep(KEY, "b", ids(1, 3))
    cache.keep(KEY, "a", ids(1, 2, 4))  # a used again: the most recent
    cache.keep(KEY, "c", ids(1, 5))
    assert evicted == ["b"] and cache.counts.evicted == 1 and len(cache) == 2
    cache.take(KEY, "a")
    assert cache.match(KEY, ids(1, 2, 4, 8), min_fork=1).kept.session_id == "c"  # type: ignore[union-attr]
    assert sorted(cache.drain()) == ["c"] and len(cache) == 0
    off = PrefixCache(0, evicted.append)
    off.keep(KEY, "d", ids(1))
    assert evicted[-1] == "d" and len(off) == 0


def test_a_forgotten_session_is_handed_over_to_be_closed():
    closed: list[str] = []
    cache = PrefixCache(4, closed.append)
    cache.keep(KEY, "a", ids(1, 2))
    cache.forget(KEY, "a")
    cache.forget(KEY, "a")  # not kept any more: nothing to close
    cache.forget(("tenant-b", "chat"), "b")
    assert closed == ["a"] and len(cache) == 0
