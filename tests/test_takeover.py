"""``cluster.takeover`` on its own: when a worker may take a session over."""

from __future__ import annotations

from ssmserve.server.cluster.takeover import Takeovers
from ssmserve.server.state.store_errors import LeaseHeldError


def held(beat: str, owner_lease_ms: int = 5000, ttl_ms: int = 0) -> LeaseHeldError:
    return LeaseHeldError(
        "held", owner="a:1", retry_after_ms=ttl_ms, beat=beat, owner_lease_ms=owner_lease_ms
    )


def test_no_proof_until_the_beat_stood_a_whole_ttl_on_this_clock():
    t = Takeovers(lease_ttl_s=5.0)
    assert t.proof("x", now=0.0) == ""
    error = t.saw("x", held("7"), now=10.0)
    assert error.retry_after_ms == 5000  # the watch's rest, though Redis says 0
    assert t.proof("x", now=14.9) == ""
    assert t.saw("x", held("7"), now=12.0).retry_after_ms == 3000  # same beat: same watch
    assert t.proof("x", now=15.0) == "7"


def test_a_beat_that_moved_starts_the_watch_again():
    t = Takeovers(lease_ttl_s=5.0)
    t.saw("x", held("7"), now=0.0)
    t.saw("x", held("8"), now=4.0)  # the owner renewed: alive
    assert t.proof("x", now=6.0) == ""
    assert t.proof("x", now=9.0) == "8"


def test_the_longer_ttl_of_owner_and_watcher_is_waited():
    t = Takeovers(lease_ttl_s=1.0)
    t.saw("x", held("1", owner_lease_ms=30_000), now=0.0)
    assert t.proof("x", now=29.0) == ""
    assert t.proof("x", now=30.0) == "1"


def test_a_longer_hint_from_redis_is_kept_and_the_watch_is_bounded():
    t = Takeovers(lease_ttl_s=1.0, limit=2)
    assert t.saw("x", held("1", 500, ttl_ms=4000), now=0.0).retry_after_ms == 4000
    t.saw("y", held("1"), now=0.0)
    t.saw("z", held("1"), now=0.0)  # the oldest sighting goes
    assert len(t) == 2 and t.proof("x", now=100.0) == ""
    t.forget("y")
    assert len(t) == 1
