"""Several versions of a model on a worker: new sessions take the newest unless they name
one, and a session stays on its version (fingerprint) across restarts and migrations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ssmserve.client.errors import FailedPrecondition, InvalidArgument, NotFound, StepFailed
from ssmserve.client.sync import Client
from ssmserve.server.engine.demo import DemoSpec, demo_config
from ssmserve.server.engine.mamba import MambaModel
from ssmserve.server.sessions.models import ServedModels, version_order
from tests.conftest import random_inputs, write_model
from tests.test_service import assert_bit_equal


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, MambaModel]]:
    """Three versions of "sig": same shapes, different weights."""
    root = tmp_path_factory.mktemp("versions")
    out = {}
    for version, seed in (("1", 101), ("2", 102), ("10", 110)):
        directory = root / f"sig-{version}"
        out[f"sig@{version}"] = (directory, write_model(directory, demo_config(DemoSpec()), seed))
    return out


def steps(worker_or_client, sid: str, x: np.ndarray, first_step: int | None = None) -> np.ndarray:
    client = getattr(worker_or_client, "client", worker_or_client)
    return np.stack([o.output for o in client.stream_steps(sid, list(x), first_step=first_step)])


def reference(model: MambaModel, x: np.ndarray) -> np.ndarray:
    return model.run(x)[0]


def test_versions_sort_naturally_and_bare_names_mean_the_newest(versions):
    assert sorted(["10", "9", "1.10", "1.9", "2"], key=version_order) == [
        "1.9", "1.10", "2", "9", "10"
    ]  # fmt: skip
    served = ServedModels({k: m for k, (_, m) in versions.items()})
    assert served.versions("sig") == ["sig@1", "sig@2", "sig@10"]
    assert served.resolve("sig") == "sig@10" and served.resolve("sig@2") == "sig@2"
    assert served.newest("sig@10") and not served.newest("sig@1")
    with pytest.raises(Exception, match="not served here"):
        served.resolve("sig@3")
    with pytest.raises(ValueError, match="NAME@VERSION"):
        ServedModels({"bad,name": versions["sig@1"][1]})


def test_new_sessions_take_the_newest_version_and_stay_on_theirs(redis_url, versions, capsys):
    from tests.harness import WorkerHarness

    keys = ["sig@1", "sig@2", "sig@10"]
    w = WorkerHarness({k: versions[k][0] for k in keys}, redis_url)
    try:
        newest = w.client.create_session("sig")
        pinned = w.client.create_session("sig@1")
        assert (newest.model, pinned.model) == ("sig@10", "sig@1")
        x = random_inputs(versions["sig@1"][1], 12, seed=91)
        assert_bit_equal(steps(w, newest.session_id, x), reference(versions["sig@10"][1], x))
        assert_bit_equal(steps(w, pinned.session_id, x), reference(versions["sig@1"][1], x))
        with pytest.raises(NotFound, match="not served here"):
            w.client.create_session("sig@3")
        listing = w.client.list_models()
        assert [(m.key, m.version, m.newest, m.resident_sessions) for m in listing.models] == [
            ("sig@1", "1", False, 1), ("sig@2", "2", False, 0), ("sig@10", "10", True, 1)
        ]  # fmt: skip
        assert listing.models[0].fingerprint == versions["sig@1"][1].fingerprint
        from ssmserve.client.cli import main

        assert main(["--server", w.address, "models", "--json"]) == 0
        (reply,) = json.loads(capsys.readouterr().out)
        assert reply["worker"] == w.address and len(reply["models"]) == 3
        # An import by bare name finds the version whose weights made the checkpoint.
        blob = w.client.export_checkpoint(pinned.session_id)
        copy = w.client.import_checkpoint(blob, "copy", model="sig")
        assert copy.model == "sig@1"
    finally:
        w.stop()


def test_a_session_keeps_its_version_across_a_restart_and_is_sent_where_it_is_served(
    redis_url, versions
):
    from tests.harness import WorkerHarness

    v1 = versions["sig@1"][1]
    x = random_inputs(v1, 20, seed=92)
    first = WorkerHarness({k: versions[k][0] for k in ("sig@1", "sig@2")}, redis_url)
    sid = first.client.create_session("sig@1").session_id
    steps(first, sid, x[:8])
    first.stop()  # parks the session: no other worker serves sig@1
    # A new worker with a newer version too: the session stays on sig@1.
    second = WorkerHarness({k: versions[k][0] for k in ("sig@1", "sig@10")}, redis_url)
    only_newer = WorkerHarness({"sig@10": versions["sig@10"][0]}, redis_url)
    try:
        assert second.client.get_session(sid).model == "sig@1"
        assert_bit_equal(steps(second, sid, x[8:14], first_step=9), reference(v1, x)[8:14])
        # A worker without sig@1 sends the client to one with it; the bits go on.
        with Client(only_newer.address) as via_newer:
            got = steps(via_newer, sid, x[14:], first_step=15)
        assert_bit_equal(got, reference(v1, x)[14:])
        # Migrating to a worker that does not serve its version is refused.
        with pytest.raises((FailedPrecondition, InvalidArgument, NotFound)):
            second.client.migrate(sid, only_newer.address)
        assert second.client.get_session(sid).owner == second.address
    finally:
        only_newer.stop()
        second.stop()


def test_a_session_whose_version_nobody_serves_says_so(redis_url, versions):
    from tests.harness import WorkerHarness

    old = WorkerHarness({"sig@1": versions["sig@1"][0]}, redis_url)
    sid = old.client.create_session("sig").session_id
    steps(old, sid, random_inputs(versions["sig@1"][1], 3, seed=93))
    old.stop()
    new = WorkerHarness({"sig@2": versions["sig@2"][0]}, redis_url)
    try:
        with pytest.raises(StepFailed, match=r"runs model 'sig@1', which no live worker serves"):
            new.client.step(sid, np.zeros(4, np.float32), step=4)
        assert new.client.get_session(sid).step == 3  # still there, on its version
    finally:
        new.stop()


def test_a_version_loads_and_unloads_in_a_running_worker_while_sessions_stream(
    redis_url, versions, capsys
):
    import threading

    from ssmserve.client.cli import main
    from tests.harness import WorkerHarness

    v1, v2 = versions["sig@1"][1], versions["sig@2"][1]
    x = random_inputs(v1, 200, seed=94)
    w = WorkerHarness({"sig@1": versions["sig@1"][0]}, redis_url)
    try:
        old = w.client.create_session("sig").session_id
        got: list[np.ndarray] = []
        # A stream on sig@1 runs all through the load and the failed unload.
        streaming = threading.Thread(target=lambda: got.append(steps(w, old, x)))
        streaming.start()
        reply = w.client.load_model("sig@2", str(versions["sig@2"][0]))
        assert [(m.key, m.newest) for m in reply.models] == [("sig@1", False), ("sig@2", True)]
        new = w.client.create_session("sig")
        assert new.model == "sig@2"  # the newest now
        assert_bit_equal(steps(w, new.session_id, x[:10]), reference(v2, x[:10]))
        with pytest.raises(FailedPrecondition, match="1 sessions resident here run model"):
            w.client.unload_model("sig@1")
        streaming.join(60)
        assert not streaming.is_alive()
        assert_bit_equal(got[0], reference(v1, x))  # the stream never noticed
        with pytest.raises(Exception, match="served here already"):
            w.client.load_model("sig@2", str(versions["sig@2"][0]))
        with pytest.raises(InvalidArgument, match="does not exist"):
            w.client.load_model("sig@3", "/nonexistent/model/dir")
        w.client.close_session(old)
        assert main(["--server", w.address, "unload-model", "sig@1", "--json"]) == 0
        assert [m["key"] for m in json.loads(capsys.readouterr().out)["models"]] == ["sig@2"]
        with pytest.raises(NotFound, match="not served here"):
            w.client.create_session("sig@1")
        # The registry says so at once: routing and migration pick workers by model.
        assert w.client.list_workers()[0].models == ["sig@2"]
        w.client.close_session(new.session_id)
        with pytest.raises(FailedPrecondition, match="last one"):
            w.client.unload_model("sig@2")
    finally:
        w.stop()


def test_only_admins_load_and_unload_models(start_worker, tokens, versions):
    from ssmserve.client.errors import PermissionDenied

    w = start_worker(auth_tokens=tokens["path"])
    for who in ("a", "operator"):
        with Client(w.address, token=tokens[who]) as c, pytest.raises(PermissionDenied):
            c.load_model("sig@1", str(versions["sig@1"][0]))
    with Client(w.address, token=tokens["admin"]) as admin:
        assert "sig@1" in [
            m.key for m in admin.load_model("sig@1", str(versions["sig@1"][0])).models
        ]
        assert "sig@1" not in [m.key for m in admin.unload_model("sig@1").models]


def test_upgrade_replays_the_kept_inputs_through_the_new_version(redis_url, versions, capsys):
    from ssmserve.client.cli import main
    from tests.harness import WorkerHarness

    v1, v2 = versions["sig@1"][1], versions["sig@2"][1]
    x = random_inputs(v1, 45, seed=95)
    w = WorkerHarness({k: versions[k][0] for k in ("sig@1", "sig@2")}, redis_url)
    try:
        # Everything kept (the snapshot at 0 stays): the new state is exactly sig@2's.
        whole = w.client.create_session("sig@1", snapshot_every=8, max_snapshots=64).session_id
        steps(w, whole, x[:30])
        reply = w.client.upgrade(whole)  # the newest: sig@2
        assert (reply.from_model, reply.session.model, reply.session.step) == (
            "sig@1", "sig@2", 30
        )  # fmt: skip
        assert (reply.replayed_from_step, reply.replayed_steps) == (1, 30)
        assert_bit_equal(steps(w, whole, x[30:], first_step=31), reference(v2, x)[30:])
        # A resend of the step it was at gets the new version's output of that step.
        assert_bit_equal(w.client.step(whole, x[44], step=45).output, reference(v2, x)[44])
        again = w.client.upgrade(whole, "sig@2")
        assert (again.replayed_steps, again.session.step) == (0, 45)  # nothing to do
        # Retention dropped the oldest inputs: the new version sees the kept ones only.
        part = w.client.create_session("sig@1", snapshot_every=4, max_snapshots=2).session_id
        steps(w, part, x[:30])
        kept_from = w.client.list_snapshots(part)[0].step + 1
        assert main(["--server", w.address, "upgrade", part, "--model", "sig@2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert int(out["replayedFromStep"]) == kept_from > 1
        snapshots = w.client.list_snapshots(part)  # the old version's went
        assert [(r.step, r.reason) for r in snapshots] == [(30, "upgrade")]
        fresh = reference(v2, x[kept_from - 1 :])  # sig@2 from a fresh state at kept_from
        assert_bit_equal(steps(w, part, x[30:], first_step=31), fresh[30 - kept_from + 1 :])
        with pytest.raises(NotFound):
            w.client.upgrade(part, "sig@7")
    finally:
        w.stop()


def test_upgrade_refuses_a_model_of_other_shapes(start_worker):
    w = start_worker()
    sid = w.client.create_session("demo").session_id
    with pytest.raises(FailedPrecondition, match="other shapes"):
        w.client.upgrade(sid, "odd")
    assert w.client.get_session(sid).model == "demo"


def test_a_migrated_session_stays_on_its_version(redis_url, versions):
    from tests.harness import WorkerHarness

    v1 = versions["sig@1"][1]
    x = random_inputs(v1, 24, seed=96)
    a = WorkerHarness({k: versions[k][0] for k in ("sig@1", "sig@2")}, redis_url)
    b = WorkerHarness({k: versions[k][0] for k in ("sig@1", "sig@2", "sig@10")}, redis_url)
    try:
        sid = a.client.create_session("sig@1").session_id
        steps(a, sid, x[:12])
        assert a.client.migrate(sid, b.address).target == b.address
        info = b.client.get_session(sid)
        assert (info.model, info.owner) == ("sig@1", b.address)  # not b's newest, sig@10
        assert_bit_equal(steps(b, sid, x[12:], first_step=13), reference(v1, x)[12:])
    finally:
        b.stop()
        a.stop()
