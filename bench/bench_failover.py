"""Failover after a freeze (SIGSTOP) of the owning worker, next to kill -9, in one run.

Usage: ``.venv/bin/python bench/bench_failover.py [--quick] [--rounds N] [--json OUT]
[--baseline-tree PATH]``

Processes: one private redis-server (AOF on, appendfsync everysec) and, per lease TTL
(0.5 / 1 / 2 s), two ``python -m ssmserve.server.main --lease-ttl S`` workers on loopback
(``tests/worker_process.WorkerProcess``: fixed ports, kept across restarts), all sharing
that Redis; this process is the client (``ssmserve.client.aio.AsyncClient``).

One session per TTL group, created once; a round streams it through a new client that
knows both workers of the group: one step per message, the next one sent when the
previous one is answered and at least ``PACE_S`` after the previous one was drawn
(``RetryPolicy(window=1)``, inputs from an async generator); ``stall_timeout_s`` is 600 s
so that only the client's gRPC keepalive (or a reset connection) notices a lost worker.
After 3 answers and a random 0 .. TTL / 3 s (a random phase against the lease renewals,
every TTL / 3) the session's owner gets SIGSTOP (``freeze``) or SIGKILL (``kill -9``).
Takeover = arrival of the first answer from the other worker minus the signal; gap = the
same answer minus the last answer before it. Every step is checked to be answered
exactly once and in order, and none by the old owner after the takeover. Then a frozen
owner gets SIGCONT and its log should say that it dropped the session (it was fenced; a
round where it does not within 5 s is listed), and a worker of another group is asked
the session's owner (``GetSession``), which must be the other worker. So every round
starts with two live workers, one of them holding the session, and the victim alternates.

Each repetition runs every configuration once, in a shuffled order. Each kill -9 is
followed by a freeze with the slow (2/2 s) client keepalive in another group, and the
killed worker starts again (about 1 s of CPU) from that round's SIGSTOP on, while that
round's client waits out its 2 s keepalive timeout; a round whose takeover came less
than 0.25 s after the restart was up is run again (with nothing starting) and counted in
the report. So the machine's drift spreads over all configurations, and no time goes to
restarts alone.

A round with no answer from the other worker within ``bench_migration.FOLLOW_TIMEOUT_S``
is counted as stuck (the victim is then resumed) and left out of the percentiles; rounds
over TTL + keepalive timeout + 1 s (kill -9: TTL + 1 s) are listed with the workers' log
lines of that round (stderr, and the JSON).

``--baseline-tree PATH`` (a checkout of another commit, e.g. a git worktree) adds a second
set of groups whose workers run that tree's server (``PYTHONPATH=PATH/server:PATH/client``,
same venv), on a redis-server of their own; their rounds are shuffled into the same
repetitions as this checkout's, so both see the same drift of this shared machine, and
the report adds per (fault, TTL) the ratio this checkout / baseline. The client (this
process) is this checkout's for both. The last line of the output is one JSON object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_migration import FOLLOW_TIMEOUT_S, Stream, pct
from harness import private_redis, standard_parser, table, write_result

from ssmserve.client.aio import AsyncClient
from ssmserve.client.retry import RetryPolicy
from ssmserve.server.main import ensure_demo_model
from tests.worker_process import WorkerProcess

TTLS = (0.5, 1.0, 2.0)
KEEPALIVES = ((0.5, 0.5), (2.0, 2.0))  # client keepalive_time_s / keepalive_timeout_s
DEFAULT_KEEPALIVE = (RetryPolicy().keepalive_time_s, RetryPolicy().keepalive_timeout_s)
PACE_S = 0.004  # at least this long between two steps drawn from the input generator
STALL_S = 600.0  # the client's stall timer never fires here: keepalive must notice
DROP_WAIT_S = 5.0  # how long a resumed victim may take to log that it dropped the session
CURRENT, BASELINE = "current", "baseline"  # which server code a group's workers run
GroupKey = tuple[str, float]  # (code, lease TTL)


# ---------------------------------------------------------------------------- streaming


async def paced(items: Iterable[Any], pace_s: float) -> AsyncIterator[Any]:
    for item in items:
        await asyncio.sleep(pace_s)
        yield item


class PacedClient(AsyncClient):
    """An AsyncClient whose streams draw their inputs at most one per ``PACE_S``."""

    def stream_steps(self, session_id: str, inputs: Any, **kwargs: Any) -> Any:
        return super().stream_steps(session_id, paced(inputs, PACE_S), **kwargs)


class FollowedStream(Stream):
    """bench_migration's Stream; a waiter also wakes when the stream ends (with the
    error that ended it, instead of waiting out the follow timeout)."""

    async def _run(self, first_step: int) -> None:
        try:
            await super()._run(first_step)
        finally:
            self._new.set()


# ---------------------------------------------------------------------------- one round


@dataclasses.dataclass(frozen=True)
class Config:
    ttl: float
    keepalive: tuple[float, float]
    event: str  # "freeze" or "kill -9"
    code: str = CURRENT  # CURRENT or BASELINE: the server code of the group's workers

    @property
    def group(self) -> GroupKey:
        return (self.code, self.ttl)

    @property
    def label(self) -> str:
        return f"{self.keepalive[0]:g}/{self.keepalive[1]:g}"

    @property
    def bound_s(self) -> float:
        """TTL + keepalive timeout + 1 s (kill -9: the reset is seen at once: TTL + 1 s)."""
        return self.ttl + (self.keepalive[1] if self.event == "freeze" else 0.0) + 1.0


@dataclasses.dataclass
class Round:
    config: Config
    victim: str
    successor: str
    takeover_s: float | None  # None: stuck (no answer from the successor in time)
    gap_s: float | None
    logs: str = ""  # both workers' log lines of this round (kept for slow or stuck rounds)
    restart_s: float | None = None  # a killed worker was started again meanwhile: up after

    @property
    def overlapped(self) -> bool:
        """A worker was still starting 0.25 s before the takeover: the round is run again."""
        if self.restart_s is None:
            return False
        return self.takeover_s is None or self.restart_s > self.takeover_s - 0.25

    def to_json(self) -> dict[str, object]:
        c = self.config
        times = {"takeover_ms": self.takeover_s, "gap_ms": self.gap_s,
                 "restart_up_ms": self.restart_s}  # fmt: skip
        ms = {k: None if v is None else v * 1e3 for k, v in times.items()}
        return {"code": c.code, "ttl_s": c.ttl, "keepalive_s": list(c.keepalive),
                "event": c.event, "victim": self.victim, **ms, "logs": self.logs}  # fmt: skip


class Group:
    """The two workers of one lease TTL (running one server code) and their one long-lived
    session: each round signals its current owner, so the victim alternates between the two."""

    def __init__(
        self,
        key: GroupKey,
        models: dict[str, Path],
        redis_url: str,
        root: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.code, self.ttl = key
        self.workers = [
            WorkerProcess(
                models, redis_url, root / f"{self.code}-ttl{self.ttl:g}-{i}",
                lease_ttl_s=self.ttl, env=env,
            )
            for i in range(2)
        ]  # fmt: skip
        self.session_id = ""

    async def create_session(self) -> None:
        async with AsyncClient(self.workers[0].address, discover=False) as client:
            self.session_id = (await client.create_session("demo")).session_id

    def roles(self, owner: str) -> tuple[WorkerProcess, WorkerProcess]:
        """(the owner, the other one)."""
        a, b = self.workers
        assert owner in (a.address, b.address), (owner, a.address, b.address)
        return (a, b) if owner == a.address else (b, a)


def log_offsets(workers: Iterable[WorkerProcess]) -> dict[WorkerProcess, int]:
    return {w: w.log.stat().st_size if w.log.exists() else 0 for w in workers}


def log_since(offsets: dict[WorkerProcess, int]) -> str:
    parts = []
    for w, offset in offsets.items():
        with w.log.open(errors="replace") as f:
            f.seek(offset)
            lines = f.read().splitlines()
        parts.append(f"  [{w.address} {w.log}]")
        parts += [f"    {line}" for line in lines[-20:]] or ["    (nothing)"]
    return "\n".join(parts)


async def wait_for_log(worker: WorkerProcess, offset: int, needle: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with worker.log.open(errors="replace") as f:
            f.seek(offset)
            if needle in f.read():
                return True
        await asyncio.sleep(0.02)
    return False


class Restart:
    """A killed worker started again in a thread; ``ended`` is when it was up (or failed)."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker = worker
        self.started = time.perf_counter()
        self.ended = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.start()
        except BaseException as exc:
            self.error = exc
        self.ended = time.perf_counter()

    async def join(self) -> None:
        await asyncio.to_thread(self.thread.join, 90)
        if self.error is not None or not self.worker.ready:
            raise RuntimeError(f"worker {self.worker.address} did not restart: {self.error}")


async def takeover_round(
    group: Group,
    config: Config,
    witness: WorkerProcess,
    rng: random.Random,
    restart: WorkerProcess | None = None,
) -> Round:
    """One freeze or kill -9 of the owner of the group's session; ``witness`` (a worker of
    another group) reports the new owner; ``restart`` (a killed worker of another group) is
    started again at the signal."""
    sid = group.session_id
    policy = RetryPolicy(
        window=1,
        stall_timeout_s=STALL_S,
        keepalive_time_s=config.keepalive[0],
        keepalive_timeout_s=config.keepalive[1],
    )
    addresses = [w.address for w in group.workers]
    client = PacedClient(addresses, discover=False, retry=policy)
    restarting: Restart | None = None
    stuck = False
    try:
        info = await client.get_session(sid)
        victim, successor = group.roles(info.owner)
        offsets = log_offsets([victim, successor])
        stream = FollowedStream(client, sid, info.step + 1)
        try:
            await stream.wait_for(victim.address, 3, 0, "before the signal")
            await asyncio.sleep(rng.uniform(0.0, config.ttl / 3))
            mark = len(stream.answers)
            assert victim.proc is not None
            signalled = time.perf_counter()
            os.kill(victim.proc.pid, signal.SIGSTOP if config.event == "freeze" else signal.SIGKILL)
            if restart is not None:
                restarting = Restart(restart)
            try:
                await stream.wait_for(successor.address, 3, mark, f"{config} takeover")
            except RuntimeError:
                if stream._task.done() or config.event != "freeze":
                    raise  # the stream itself failed, or a dead owner was not replaced
                stuck = True  # the client never left the frozen owner: resume it
                victim.resume()
                await asyncio.sleep(1.0)
        finally:
            await stream.stop()
        stream.check_order(info.step + 1)
    finally:
        await client.close()
        if restarting is not None:
            await restarting.join()
    restart_s = restarting.ended - signalled if restarting is not None else None
    if stuck:
        logs = log_since(offsets)
        return Round(config, victim.address, successor.address, None, None, logs, restart_s)

    answers = stream.answers
    first = next(i for i in range(mark, len(answers)) if answers[i][2] == successor.address)
    later = [by for _, _, by in answers[first:]]
    assert set(later) == {successor.address}, f"answers from {set(later)} after the takeover"
    takeover = answers[first][0] - signalled
    gap = answers[first][0] - answers[first - 1][0]

    # Put a frozen victim back (a killed one starts again during the next round, in
    # another group): every round starts with two live workers, one of them the owner.
    dropped = True
    if config.event == "freeze":
        victim.resume()
        dropped = await wait_for_log(
            victim, offsets[victim], f"session {sid} dropped from memory", DROP_WAIT_S
        )
    else:
        victim.kill()  # reap it
    async with AsyncClient(witness.address, discover=False) as via_witness:
        owner = (await via_witness.get_session(sid)).owner
    assert owner == successor.address, f"owner {owner}, expected {successor.address}"
    logs = log_since(offsets) if takeover > config.bound_s or not dropped else ""
    if not dropped:
        logs = (
            f"  (the resumed victim did not log dropping {sid} within {DROP_WAIT_S:g} s)\n" + logs
        )
    return Round(config, victim.address, successor.address, takeover, gap, logs, restart_s)


# ---------------------------------------------------------------------------- main


def start_all(workers: list[WorkerProcess]) -> None:
    """In parallel: a worker takes about a second to start."""
    threads = [threading.Thread(target=w.start) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    dead = [w.address for w in workers if not w.alive]
    if dead:
        raise SystemExit(f"workers did not start: {dead}")


def schedule(keys: list[GroupKey], rng: random.Random) -> list[list[Config]]:
    """One repetition: every configuration of every group (code, TTL) once, in a shuffled
    order of items. A kill -9 is paired with a freeze of another group with the slowest
    client keepalive, during whose wait (>= its keepalive timeout, 2 s) the killed worker
    starts again (about 1 s: it is not waited for separately, and the round checks that it
    was up in time)."""
    fast, slow = sorted(KEEPALIVES, key=sum)
    while True:
        killed = rng.sample(keys, len(keys))
        frozen = rng.sample(keys, len(keys))
        if all(k != f for k, f in zip(killed, frozen, strict=True)):
            break
    items = [[Config(ttl, fast, "freeze", code)] for code, ttl in keys]
    items += [
        [Config(k[1], DEFAULT_KEEPALIVE, "kill -9", k[0]), Config(f[1], slow, "freeze", f[0])]
        for k, f in zip(killed, frozen, strict=True)
    ]
    rng.shuffle(items)
    return items


async def bench(
    groups: dict[GroupKey, Group], reps: int, seed: int
) -> tuple[list[Round], list[Round]]:
    """The rounds kept, and those run again because a restart overlapped their takeover."""
    rng = random.Random(seed)
    rounds: list[Round] = []
    redone: list[Round] = []
    for g in groups.values():
        await g.create_session()
    # From now on the leases run on their owners' renewal schedules (every TTL / 3), as
    # those of a session that has been streaming for a while.
    await asyncio.sleep(max(g.ttl for g in groups.values()))
    for rep in range(reps):
        t0 = time.perf_counter()
        for item in schedule(list(groups), rng):
            dead: WorkerProcess | None = None
            for config in item:
                group = groups[config.group]
                # a live worker of another group running the same code (its own Redis)
                witness = next(
                    w
                    for g in groups.values()
                    if g is not group and g.code == group.code
                    for w in g.workers
                    if w.ready
                )
                r = await takeover_round(group, config, witness, rng, restart=dead)
                if r.overlapped:  # again, with nothing starting meanwhile
                    redone.append(r)
                    r = await takeover_round(group, config, witness, rng)
                rounds.append(r)
                dead = next((w for w in group.workers if not w.ready), None)
                if r.logs:
                    what = "stuck" if r.takeover_s is None else f"{r.takeover_s * 1e3:,.0f} ms"
                    print(f"slow round: {config.code} code, TTL {config.ttl:g} s, "
                          f"keepalive {config.label}, "
                          f"{config.event}: {what} (victim {r.victim})\n{r.logs}",
                          file=sys.stderr, flush=True)  # fmt: skip
            assert dead is None, "a killed worker was not started again"
        print(f"(repetition {rep + 1}/{reps}: {time.perf_counter() - t0:.1f} s)", flush=True)
    return rounds, redone


@dataclasses.dataclass(frozen=True)
class Figures:
    """Takeover figures of one configuration (ms; zeros when no round finished)."""

    config: Config
    n: int
    stuck: int
    over_bound: int
    p50: float
    p90: float
    p99: float
    worst: float
    gap_p50: float | None
    takeover_ms: list[float]

    @classmethod
    def of(cls, c: Config, rounds: list[Round]) -> Figures:
        done = [r for r in rounds if r.takeover_s is not None and r.gap_s is not None]
        ms = [r.takeover_s * 1e3 for r in done if r.takeover_s is not None]
        gaps = [r.gap_s * 1e3 for r in done if r.gap_s is not None]
        over = sum(1 for v in ms if v > c.bound_s * 1e3)
        qs = [pct(ms, q) for q in (50, 90, 99)] + [max(ms)] if ms else [0.0] * 4
        gap = pct(gaps, 50) if gaps else None
        return cls(c, len(ms), len(rounds) - len(done), over, *qs, gap, ms)

    def to_json(self) -> dict[str, object]:
        c = self.config
        return {
            "code": c.code, "ttl_s": c.ttl, "keepalive_s": list(c.keepalive), "event": c.event,
            "n": self.n, "stuck": self.stuck, "over_bound": self.over_bound,
            "bound_ms": c.bound_s * 1e3, "p50_ms": self.p50, "p90_ms": self.p90,
            "p99_ms": self.p99, "max_ms": self.worst, "p50_over_ttl": self.p50 / (c.ttl * 1e3),
            "gap_p50_ms": self.gap_p50, "takeover_ms": self.takeover_ms,
        }  # fmt: skip


def report(rounds: list[Round], redone: list[Round]) -> tuple[str, str, list[Figures]]:
    """The table, a note on the restarts during freeze rounds, and the figures."""
    by_config: dict[Config, list[Round]] = {}
    for r in rounds:
        by_config.setdefault(r.config, []).append(r)
    order = sorted(by_config, key=lambda c: (c.code, c.event != "freeze", c.keepalive, c.ttl))
    figures = [Figures.of(c, by_config[c]) for c in order]
    several = len({c.code for c in order}) > 1
    rows: list[list[object]] = []
    for f in figures:
        c = f.config
        row: list[object] = [c.ttl, c.label, c.event, f.n, f.p50, f.p90, f.p99, f.worst,
                             f.p50 / (c.ttl * 1e3), "-" if f.gap_p50 is None else f.gap_p50,
                             f.over_bound + f.stuck]  # fmt: skip
        rows.append([c.code, *row] if several else row)
    headers = ["lease TTL s", "client keepalive s", "event", "n", "p50 ms", "p90 ms", "p99 ms",
               "max ms", "p50 / TTL", "gap p50 ms", "over bound"]  # fmt: skip
    if several:
        headers = ["code", *headers]
    up = [r.restart_s * 1e3 for r in rounds + redone if r.restart_s is not None]
    note = ""
    if up:
        note = (f"killed workers started again during {len(up)} freeze rounds of another "
                f"group: up {pct(up, 50):,.0f} ms (p50; max {max(up):,.0f} ms) after that "
                f"round's SIGSTOP; {len(redone)} of them still starting 0.25 s before that "
                "round's takeover (such rounds are run again, with nothing starting)")  # fmt: skip
    return table(headers, rows), note, figures


def comparison(figures: list[Figures]) -> tuple[str, list[dict[str, object]]]:
    """Per (event, keepalive, TTL) measured with both codes: takeover p50 / p90 / max of
    each and the ratios current / baseline (nothing when only one code ran)."""
    pairs: dict[tuple[str, tuple[float, float], float], dict[str, Figures]] = {}
    for f in figures:
        c = f.config
        pairs.setdefault((c.event, c.keepalive, c.ttl), {})[c.code] = f
    rows: list[list[object]] = []
    out: list[dict[str, object]] = []
    for (event, keepalive, ttl), pair in sorted(
        pairs.items(), key=lambda kv: (kv[0][0] != "freeze", kv[0][1:])
    ):
        if CURRENT not in pair or BASELINE not in pair:
            continue
        base, cur = pair[BASELINE], pair[CURRENT]
        ratios = {
            q: getattr(cur, q) / getattr(base, q) if getattr(base, q) and getattr(cur, q) else None
            for q in ("p50", "p90", "worst")
        }
        rows.append([
            event, pair[CURRENT].config.label, ttl, f"{base.n} / {cur.n}",
            base.p50, base.p90, base.worst, cur.p50, cur.p90, cur.worst,
            *("-" if v is None else f"{v:.2f}" for v in ratios.values()),
            f"{base.stuck + base.over_bound} / {cur.stuck + cur.over_bound}",
        ])  # fmt: skip
        out.append({
            "event": event, "keepalive_s": list(keepalive), "ttl_s": ttl,
            **{f"{code}_{q.replace('worst', 'max')}_ms": getattr(f, q)
               for code, f in ((BASELINE, base), (CURRENT, cur)) for q in ratios},
            "n": [base.n, cur.n], "stuck": [base.stuck, cur.stuck],
            **{f"ratio_{q.replace('worst', 'max')}": v for q, v in ratios.items()},
        })  # fmt: skip
    if not rows:
        return "", out
    headers = ["event", "client keepalive s", "lease TTL s", "n base / current",
               "base p50 ms", "base p90 ms", "base max ms", "current p50 ms",
               "current p90 ms", "current max ms", "p50 current / base", "p90 current / base",
               "max current / base", "over bound or stuck: base / current"]  # fmt: skip
    return table(headers, rows), out


def baseline_env(tree: Path) -> dict[str, str]:
    """The environment of a worker running the server code of ``tree``; refuses a tree
    that does not look like a checkout of this repository."""
    server, client = tree / "server", tree / "client"
    if not (server / "ssmserve" / "server" / "main.py").is_file() or not client.is_dir():
        raise SystemExit(
            f"--baseline-tree {tree}: no server/ssmserve/server/main.py or client/ there "
            "(want a checkout of this repository, e.g. a git worktree)"
        )
    return {"PYTHONPATH": f"{server.resolve()}:{client.resolve()}"}


def main() -> int:
    parser = standard_parser(__doc__, quick="3 rounds each (smoke run)")
    parser.add_argument("--rounds", type=int, help="rounds per configuration (default 20)")
    parser.add_argument("--baseline-tree", type=Path, metavar="PATH",
                        help="also run workers of the server code in this checkout, "
                             "interleaved with this one's, and report the ratios")  # fmt: skip
    args = parser.parse_args()
    reps = args.rounds or (3 if args.quick else 20)
    envs: dict[str, dict[str, str] | None] = {CURRENT: None}
    if args.baseline_tree:
        envs[BASELINE] = baseline_env(args.baseline_tree)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        models = {"demo": ensure_demo_model(Path(tmp) / "models" / "demo")}
        groups: dict[GroupKey, Group] = {}
        for code, env in envs.items():  # each code on a redis-server of its own
            redis_server = stack.enter_context(private_redis(Path(tmp) / f"redis-{code}"))
            for ttl in TTLS:
                groups[(code, ttl)] = Group((code, ttl), models, redis_server.url, Path(tmp), env)
        workers = [w for g in groups.values() for w in g.workers]
        try:
            start_all(workers)
            print(f"({len(workers)} workers started in {time.perf_counter() - started:.1f} s; "
                  f"{reps} rounds per configuration)\n", flush=True)  # fmt: skip
            rounds, redone = asyncio.run(bench(groups, reps, seed=0))
        finally:
            for w in workers:
                w.kill()
    text, note, figures = report(rounds, redone)
    data = [f.to_json() for f in figures]
    print("\n# takeover after a freeze (SIGSTOP) or kill -9 of the owner, as a streaming "
          "client sees it\n")  # fmt: skip
    print(text)
    print(
        "\ntakeover: SIGSTOP / SIGKILL of the owner -> first answer from the other worker; "
        "gap: last answer before it -> that answer; client stall timer off (600 s); over "
        "bound: rounds above TTL + keepalive timeout + 1 s (kill -9: TTL + 1 s), stuck ones "
        f"(no takeover within {FOLLOW_TIMEOUT_S:g} s) included"
    )
    compared, ratios = comparison(figures)
    if compared:
        print(f"\n# this checkout (current) against {args.baseline_tree} (base), same run\n")
        print(compared)
    if note:
        print(f"\n{note}")
    elapsed = time.perf_counter() - started
    print(f"\n(whole benchmark: {elapsed:.0f} s)")
    if args.json:
        report_json = {"rows": data, "comparison": ratios, "restarts": note,
                       "rounds_per_config": reps, "seconds": elapsed,
                       "rounds": [r.to_json() for r in rounds],
                       "redone": [r.to_json() for r in redone]}  # fmt: skip
        write_result(args.json, report_json, line=False)
    summary = {"rows": [{k: v for k, v in d.items() if k != "takeover_ms"} for d in data],
               "comparison": ratios, "rounds_per_config": reps, "redone": len(redone),
               "seconds": round(elapsed, 1)}  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
