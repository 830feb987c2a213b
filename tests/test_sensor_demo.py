"""The sensor demo (``./dev demo``, ``ssmserve.client.sensor_demo``): the committed trained
model served by a real ``ssmserve-server`` on its own embedded Redis, real held-out readings
with two injected faults, a guard and a monitor that roll back and impute the forecast."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ssmserve.client import sensor_demo
from ssmserve.server.engine.loader import load_model

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "examples" / "models" / "cgm-mamba"
READINGS = REPO / "examples" / "data" / "cgm-heldout.npy"


def test_the_committed_model_and_readings_are_small_and_load():
    size = sum(f.stat().st_size for f in MODEL_DIR.iterdir())
    assert size < 2 * 2**20, f"the committed model is {size:,} bytes"
    model = load_model(MODEL_DIR)
    assert (model.config.input_dim, model.config.output_dim) == (2, 2)
    assert model.input_norm is not None and model.output_norm is not None
    readings = np.load(READINGS)
    assert readings.dtype == np.float32 and readings.shape[1] == 2 and len(readings) > 5000


def test_the_demo_rolls_back_and_shortens_the_wrong_predictions(tmp_path, capsys):
    picture = tmp_path / "demo.png"
    args = ["--model-dir", str(MODEL_DIR), "--readings", str(READINGS)]
    args += ["--data-dir", str(tmp_path / "data"), "--plot", str(picture)]
    assert sensor_demo.main(args) == 0
    out = capsys.readouterr().out
    assert picture.read_bytes()[:4] == b"\x89PNG"
    assert "answered the clean one's bits: yes" in out
    assert "imputed steps answered the forecast bit for bit: yes" in out
    assert "closed the demo's sessions: nothing of this run stays stored" in out
    # the spike is caught by the server's guard, the stuck sensor by the monitor; each is
    # rolled back to the step before it
    spike, stuck = sensor_demo.SPIKE_AT, sensor_demo.STUCK_FROM
    assert f"reading {spike}: guard spike-" in out and f"rollback to step {spike - 1}" in out
    assert f"stuck -> rollback to step {stuck - 1}" in out
    # with rollback, the predictions are wrong for less time than without, for each fault
    costs = re.findall(r"wrong .* for (\d+) min without rollback, (\d+) min with rollback", out)
    assert len(costs) == 2
    for without, with_rollback in costs:
        assert int(with_rollback) < int(without)


def test_the_faults_are_where_the_demo_says():
    day = np.load(READINGS)[sensor_demo.DAY_START : sensor_demo.DAY_START + sensor_demo.DAY]
    faulty, faults = sensor_demo.faulty_day(day)
    changed = np.flatnonzero((faulty != day).any(axis=1)) + 1  # 1-based steps
    (_, s0, s1), (_, k0, k1) = faults
    assert s0 == s1 == sensor_demo.SPIKE_AT
    assert set(changed) <= {s0, *range(k0, k1 + 1)} and s0 in changed
    assert (faulty[k0 - 1 : k1] == day[k0 - 2]).all()  # stuck at the last good reading
