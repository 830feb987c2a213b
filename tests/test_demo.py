"""The quick-start demo (``./dev demo``, ``ssmserve.client.demo``) against real
``ssmserve-server --demo`` processes: it leaves no session stored, in its own embedded
Redis or in a shared one, and its picture shows what the README's caption used to
explain: the guard's limit, the spike it refused, two labelled rollbacks, and legends
that cover no data."""

from __future__ import annotations

import re

import redis
from matplotlib.text import Annotation

from ssmserve.client import demo, plot
from ssmserve.client.sync import Client
from tests.worker_process import WorkerProcess


def test_the_demo_leaves_no_session_in_its_own_store(tmp_path, capsys):
    data = tmp_path / "demo-data"
    picture = tmp_path / "demo.png"
    assert demo.main(["--data-dir", str(data), "--steps", "64", "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    assert "bit for bit: yes" in out
    assert picture.read_bytes()[:4] == b"\x89PNG"
    # the same data dir, served again: its embedded Redis kept no session
    worker = WorkerProcess({}, None, data, lease_ttl_s=5.0, extra_args=("--demo",))
    try:
        worker.start(timeout_s=120)
        with Client(worker.address) as client:
            assert client.list_sessions() == []
        assert worker.terminate() == 0
    finally:
        worker.kill()
    assert "closed the demo's sessions: nothing of this run stays stored" in out


def test_the_demo_against_running_workers_leaves_no_key_behind(redis_url, tmp_path, capsys):
    worker = WorkerProcess({}, redis_url, tmp_path / "w", lease_ttl_s=5.0, extra_args=("--demo",))
    try:
        worker.start(timeout_s=120)
        code = demo.main(
            ["--server", worker.address, "--steps", "64", "--plot", str(tmp_path / "p.png")]
        )
        assert code == 0, capsys.readouterr().out
        with redis.Redis.from_url(redis_url) as r:
            assert list(r.scan_iter("ssm:{*", count=1000)) == []  # no key of any session
            assert r.zcard("ssm:sessions") == 0
        assert worker.terminate() == 0
    finally:
        worker.kill()


def test_the_picture_explains_itself(redis_url, tmp_path):
    worker = WorkerProcess({}, redis_url, tmp_path / "w", lease_ttl_s=5.0, extra_args=("--demo",))
    pyplot = plot.load_pyplot()
    try:
        worker.start(timeout_s=120)
        with Client(worker.address) as client:
            sessions = demo.DemoSessions(client)
            try:
                code, drawing = demo.run_demo(client, sessions, worker.address, 96)
                assert code == 0
                sid = drawing.session_id
                guards = client.get_session(sid).config.guards
                figure = plot.draw(pyplot, client.history(sid), 4, guards, [drawing.rejected])
            finally:
                sessions.close_all()
        figure.canvas.draw()
        top, bottom, lane = figure.axes
        (guard,) = guards
        (dim,) = guard.dims
        limit = guard.max if guard.HasField("max") else guard.min
        rejected = drawing.rejected

        # the guard's limit: a dashed line at its bound, in the watched output's colour
        dashed = [ln for ln in bottom.get_lines() if ln.get_linestyle() == "--"]
        assert [tuple(ln.get_ydata()) for ln in dashed] == [(limit, limit)]
        assert dashed[0].get_color() == f"C{dim}"
        assert f"out {dim}" in dashed[0].get_label()
        # the output the guard refused, at the step tried; the spike's input above
        refused = [ln for ln in bottom.get_lines() if ln.get_marker() == "X"]
        assert [(ln.get_xdata()[0], ln.get_ydata()[0]) for ln in refused] == [
            (rejected.step, rejected.outputs[dim])
        ]
        assert abs(float(rejected.outputs[dim])) > abs(limit)  # it did break the limit
        spike = [ln for ln in top.get_lines() if ln.get_marker() in ("^", "v", "o")]
        assert len(spike) == len(rejected.inputs)
        notes = " ".join(t.get_text() for t in top.texts)
        assert f"step {rejected.step}: input" in notes and "not kept" in notes

        # two rollbacks, two arrows: different colours, each labelled
        arrows = [a for a in lane.texts if isinstance(a, Annotation) and a.arrow_patch]
        assert len(arrows) == 2
        colours = {tuple(a.arrow_patch.get_edgecolor()) for a in arrows}
        assert len(colours) == 2
        labels = [t.get_text() for t in lane.texts if t.get_text()]
        assert any(re.fullmatch(r"guard rolled back 53 → \d+: its newest snapshot", t)
                   for t in labels), labels  # fmt: skip
        assert any(t.endswith("(Rollback call) rolled back 52 → 40: snapshot 'calm'")
                   for t in labels), labels  # fmt: skip

        # legends beside the panels, inside the picture, over no panel
        for axis in (top, bottom):
            box = axis.get_legend().get_window_extent()
            assert not box.overlaps(axis.get_window_extent())
            assert figure.bbox.x1 >= box.x1 and box.x0 >= 0
        pyplot.close(figure)
        assert worker.terminate() == 0
    finally:
        worker.kill()
