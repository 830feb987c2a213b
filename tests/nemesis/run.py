"""One nemesis run from start to verdict: build the topology, run the clients beside the
fault scheduler for the given time, repair everything, read every session back, check.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ssmserve.client.aio import AsyncClient
from ssmserve.server.engine.demo import DemoSpec, demo_config, random_tensors
from ssmserve.server.engine.loader import save_model
from tests.nemesis.checker import Expected, FinalRead, Violation, check, rewinds, stretch
from tests.nemesis.clients import (
    OP_BOUND_S,
    POLICY,
    Observer,
    Operator,
    SessionClient,
    Shared,
    in_digest,
    out_digest,
    run_clients,
)
from tests.nemesis.faults import Nemesis
from tests.nemesis.fencing import TokenSampler, acquisitions
from tests.nemesis.history import History
from tests.nemesis.topology import Topology

#: After every fault is repaired, each session must answer (a read and a forecast) within
#: this: a lease TTL to wait out, keepalive to notice a dead connection, a worker restart.
RECOVERY_BOUND_S = 30.0
#: (durability, model) of each session client.
CLIENTS = [("log", "demo"), ("log", "demo"), ("snapshot", "demo"), ("none", "demo"),
           ("log", "lm"), ("snapshot", "lm")]  # fmt: skip


@dataclass
class Outcome:
    seed: int
    topology: str
    minutes: float
    faults: Counter[str]
    requests: Counter[str]
    violations: list[Violation]
    report: list[str] = field(default_factory=list)
    history: History | None = None

    @property
    def ok(self) -> bool:
        return not self.violations


def write_models(root: Path) -> dict[str, Path]:
    """The tiny random-weight models the workers serve: a signal model and a token one
    (as tests/conftest.py makes them)."""
    from tests.conftest import token_config

    dirs = {"demo": root / "demo", "lm": root / "lm"}
    save_model(dirs["demo"], demo_config(DemoSpec()), random_tensors(demo_config(DemoSpec()), 0))
    save_model(dirs["lm"], token_config(), random_tensors(token_config(), 3))
    return dirs


def run(seed: int, minutes: float, topology: str, keep: Path | None = None) -> Outcome:
    # The client library says when it waits for a takeover: expected here, hundreds of times.
    logging.getLogger("ssmserve.client").setLevel(logging.ERROR)
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"nemesis-{topology}-{seed}-", dir=keep))
    history = History()
    topo = Topology(topology, root, write_models(root / "models"))
    print(f"nemesis: seed {seed}, {minutes:g} min, {topology}; processes and logs in {root}")
    topo.start()
    shared = Shared(topo, history, seed)
    sampler = TokenSampler(topo.store, history, lambda: list(shared.timelines)).start()
    clients: list[object] = [
        SessionClient(shared, f"c{i}", durability, model)
        for i, (durability, model) in enumerate(CLIENTS)
    ]
    clients += [Operator(shared), Observer(shared)]
    nemesis = Nemesis(topo, history, seed)
    try:
        thread = run_clients(shared, clients)
        time.sleep(2.0)  # sessions exist before the first fault
        nemesis.start()
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline and thread.is_alive():
            time.sleep(1.0)
        nemesis.stop()
        shared.stop.set()
        thread.join(OP_BOUND_S + 30)
        if thread.is_alive():
            history.note("the clients did not stop within their bound")
        topo.heal_all()
        history.note("every fault repaired: the final reads start")
        finals = asyncio.run(final_reads(shared))
    finally:
        sampler.stop()
        for i, w in enumerate(topo.workers):
            for sighting in acquisitions(w.log, f"w{i}"):
                history.token(sighting)
        topo.stop()
        history.dump(root / "history.json")
    expected = {
        sid: Expected(sid, t.durability, t.step, t.floor, dict(t.steps), t.lost)
        for sid, t in shared.timelines.items()
        if not t.closed
    }
    violations = check(history, expected, finals)
    violations += [Violation("harness", "", e) for e in nemesis.errors]
    outcome = Outcome(
        seed, topology, minutes, nemesis.counts,
        Counter(o.kind for o in history.ops), violations, history=history,
    )  # fmt: skip
    outcome.report = report(outcome, root, sampler.reads)
    return outcome


async def final_reads(shared: Shared) -> dict[str, FinalRead]:
    """Each session still open, read back once the faults are repaired: a forecast (it
    must be served) and its history; each within ``RECOVERY_BOUND_S``."""
    finals: dict[str, FinalRead] = {}
    async with AsyncClient(shared.topo.addresses, retry=POLICY) as client:

        async def one(sid: str) -> None:
            op = shared.history.invoke("final", sid, "final")
            try:
                await asyncio.wait_for(client.forecast(sid, 1), RECOVERY_BOUND_S)
                h = await asyncio.wait_for(client.history(sid), RECOVERY_BOUND_S)
            except Exception as exc:  # any failure is the finding
                shared.history.fail(op, exc)
                return
            rows = range(len(h.outputs))
            finals[sid] = FinalRead(
                sid, int(h.first_step + len(h.outputs) - 1), int(h.first_step),
                [in_digest(h.inputs[i].item() if h.token_input else h.inputs[i]) for i in rows],
                [out_digest(np.asarray(h.outputs[i])) for i in rows],
            )  # fmt: skip
            shared.history.ok(op, shared.worker(client, sid), finals[sid].step)

        live = [sid for sid, t in shared.timelines.items() if not t.lost and not t.closed]
        await asyncio.gather(*(one(sid) for sid in live))
    return finals


def report(outcome: Outcome, root: Path, token_reads: int) -> list[str]:
    h = outcome.history
    assert h is not None
    lines = [
        f"seed {outcome.seed}, topology {outcome.topology}, {outcome.minutes:g} min",
        "faults by kind: "
        + (", ".join(f"{k} {n}" for k, n in sorted(outcome.faults.items())) or "none"),
        f"faults in all: {sum(outcome.faults.values())}",
        "requests by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(outcome.requests.items())),
        f"requests answered with an error: {sum(1 for o in h.ops if o.ok is False)}",
        f"token sightings: {sum(1 for t in h.tokens if t.source != 'redis')} in worker logs, "
        f"{sum(1 for t in h.tokens if t.source == 'redis')} changes in {token_reads} Redis reads",
        "checks: (a) acknowledged steps kept and equal, (b) one owner at a time, "
        "(c) no token twice, (d) every request ended, (e) recovery within "
        f"{RECOVERY_BOUND_S:.0f} s",
        f"history: {root / 'history.json'}",
    ]
    back = rewinds(h.tokens)
    if back:
        lines.append(
            f"the store lost writes: a session's token went back {len(back)} time(s), "
            f"first {back[0]}"
        )
    for note in h.notes:
        lines.append(f"note: {note}")
    for v in outcome.violations:
        lines.append("")
        lines.append(f"VIOLATION ({v.rule}) session {v.session}: {v.message}")
        lines += ["  " + s for s in stretch(h, v)]
    return lines
