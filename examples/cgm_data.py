"""The data set of the trained signal model: a continuous glucose monitor's readings.

One person's CGM, every 5 minutes from March to June 2010 (52,281 rows), as Bokeh ships it
inside its sample-data package (``bokeh_sampledata.glucose``, from PyPI's
``bokeh-sampledata``; no download at run time). Licence: public domain ("supplied
directly to a Bokeh maintainer by a personal acquaintance as public-domain data", the
module's docstring). Two channels per reading: ``isig``, the sensor's raw current (nA),
and ``glucose``, the calibrated blood glucose (mg/dL). Rows whose ``isig`` reads ``nil``
(1,061, when the sensor had no signal) are left out and the rest taken as one stream, as a
gateway streams what the sensor sends.

Split in time: the first 70% trains, the next 10% picks the checkpoint, the last 20% is
held out (``examples/data/cgm-heldout.npy``, committed: the demo streams it, and
``bench/bench_signal_model.py`` checks that it is this split).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "models" / "cgm-mamba"
HELDOUT = HERE / "data" / "cgm-heldout.npy"
CHANNELS = ("isig (nA)", "glucose (mg/dL)")
TRAIN, VALID = 0.7, 0.1  # fractions, in time order; the rest is held out


def load_series() -> np.ndarray:
    """The CGM stream (t, 2) float32: isig, glucose; ``nil`` rows left out."""
    from bokeh_sampledata.glucose import data

    isig = np.array([np.nan if v == "nil" else float(v) for v in data["isig"]])
    glucose = data["glucose"].to_numpy(np.float64)
    keep = np.isfinite(isig) & np.isfinite(glucose)
    return np.stack([isig[keep], glucose[keep]], axis=1).astype(np.float32)  # (t, 2)


def split(series: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train, validation and held-out parts, in time order."""
    n = series.shape[0]
    a, b = int(n * TRAIN), int(n * (TRAIN + VALID))
    return series[:a], series[a:b], series[b:]
