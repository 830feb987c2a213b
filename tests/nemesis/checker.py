"""The checker: the rules a nemesis run must keep, applied to its history.

(a) **durability**: every step acknowledged (and not rolled back on purpose) is in the
    session's final history with the same input and output. ``snapshot``/``none``
    sessions may lose the steps after their last acknowledged snapshot (documented), no
    earlier one; a read during the run must not show a ``log`` session behind a step it
    acknowledged (nor a ``snapshot``/``none`` one behind its last snapshot); a resent step
    is answered as before; a session is never lost unless the store was wiped.
(b) **one owner**: an answer by worker X (a step, a token, a forecast, a snapshot, a
    rollback) whose request was sent after worker Y != X answered the session must come
    from an acquisition X made after Y's answer was asked for: X's newest acquisition of
    the session (its log) before X answered must be later than the invocation of Y's
    answer. Else X answered on a lease older than Y's tenure: two owners.
(c) **fencing tokens never repeat**: no token is acquired by two worker processes (logs),
    and Redis never shows one token with two owners. (Redis showing a session's token go
    back to an earlier one is the store losing writes, a failover to a replica that
    missed them: reported by :func:`rewinds`, not a violation of the workers.)
(d) **every request ends**: each has an answer or an error; none is left open or hung.
(e) **recovery**: once every fault is repaired, every session answers within the bound.

:func:`check` returns the violations, each with the ops that show it;
:func:`stretch` prints the shortest stretch of history around one.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from tests.nemesis.history import HANDOFF, Fault, History, Op, TokenSighting

#: Kinds of answers only a session's owner gives (reads like GetSession or History may
#: come from any worker, from Redis).
OWNER_ANSWERS = frozenset({"step", "token", "forecast", "snapshot", "rollback"})
#: Log timestamps are cut to the millisecond.
SLACK_S = 0.002


@dataclass
class FinalRead:
    """A session's state read after the faults stopped: its step and the digests of each
    step's input and output in its history (from ``first_step``)."""

    sid: str
    step: int
    first_step: int
    inputs: list[str]
    outputs: list[str]


@dataclass
class Expected:
    """What the client acknowledged of a session (its ``Timeline``, reduced to digests)."""

    sid: str
    durability: str
    step: int
    floor: int
    steps: dict[int, tuple[str, str | None]]
    lost: str = ""


@dataclass
class Violation:
    rule: str
    session: str
    message: str
    ops: list[Op] = field(default_factory=list)


def check(
    history: History, expected: dict[str, Expected], finals: dict[str, FinalRead]
) -> list[Violation]:
    found: list[Violation] = []
    found += check_durability(history, expected, finals)
    found += check_ownership(history)
    found += check_tokens(history.tokens)
    found += check_ends(history)
    found += check_recovery(history)
    # One violation per rule and session: the first shows it; the rest would repeat it.
    shown: set[tuple[str, str]] = set()
    first: list[Violation] = []
    for v in found:
        if (v.rule, v.session) not in shown or not v.session:
            shown.add((v.rule, v.session))
            first.append(v)
    return first


# ---------------------------------------------------------------------------- (a)


def check_durability(
    history: History, expected: dict[str, Expected], finals: dict[str, FinalRead]
) -> list[Violation]:
    """Rule (a), but for a session whose token Redis showed going back before the loss
    was seen: then the store itself lost acknowledged writes (Redis Sentinel promoted a
    replica that had lost them: docs/fault-model.md), which ssmserve cannot undo, only
    report (the client is answered SESSION_REWOUND); such losses are noted, not failed."""
    found = _durability(history, expected, finals)
    lost_by_store = _store_losses(history.tokens)
    kept: list[Violation] = []
    noted: set[str] = set()
    for v in found:
        # Between the step's last answer and the read that found it missing (the final
        # read, when no read during the run did).
        reads = [o.complete or o.invoke for o in v.ops if o.kind not in ANSWERED_STEPS]
        until = max(reads, default=float("inf"))
        acked = [
            at
            for o in v.ops
            if o.kind in ANSWERED_STEPS and (at := o.complete or o.invoke) <= until
        ]
        since = max(acked, default=0.0)
        if any(since <= at <= until for at in lost_by_store.get(v.session, ())):
            if v.session not in noted:  # once a session: the first shows it
                noted.add(v.session)
                history.note(f"the store lost acknowledged writes of {v.session}: {v.message}")
        else:
            kept.append(v)
    return kept


def _store_losses(tokens: list[TokenSighting]) -> dict[str, list[float]]:
    """When Redis showed each session's token go back to one it had before."""
    at: dict[str, list[float]] = defaultdict(list)
    seen: dict[str, list[str]] = defaultdict(list)
    for t in sorted((t for t in tokens if t.source == "redis"), key=lambda t: t.at):
        tokens_of = seen[t.session]
        if tokens_of and tokens_of[-1] != t.token and t.token in tokens_of:
            at[t.session].append(t.at)
        if not tokens_of or tokens_of[-1] != t.token:
            tokens_of.append(t.token)
    return at


def _durability(
    history: History, expected: dict[str, Expected], finals: dict[str, FinalRead]
) -> list[Violation]:
    found: list[Violation] = []
    wiped = [f.start for f in history.faults if f.kind == "redis-restart-wiped"]
    for sid, e in expected.items():
        if e.lost:
            if not wiped:
                failed = [o for o in history.ops if o.session == sid and o.error][-3:]
                found.append(
                    Violation("a", sid, f"the session was lost with no wipe: {e.lost}", failed)
                )
            continue
        final = finals.get(sid)
        if final is None:
            continue  # closed, or no final read (rule e reports that)
        keeps = e.step if e.durability == "log" else e.floor
        for step, (in_d, out_d) in sorted(e.steps.items()):
            if step > final.step:
                if step <= keeps:
                    found.append(Violation(
                        "a", sid, f"acknowledged step {step} is missing: the session ends at "
                        f"step {final.step} ({e.durability} durability, must keep "
                        f"{keeps})", _ops_of_step(history, sid, step),
                    ))  # fmt: skip
                    break
                continue
            i = step - final.first_step
            if i < 0 or i >= len(final.inputs):
                continue  # outside the history kept (its window)
            if final.inputs[i] != in_d or (out_d is not None and final.outputs[i] != out_d):
                found.append(Violation(
                    "a", sid, f"step {step} differs from what was acknowledged (input "
                    f"{in_d} -> {final.inputs[i]}, output {out_d} -> {final.outputs[i]})",
                    _ops_of_step(history, sid, step),
                ))  # fmt: skip
                break
    for op in history.ops:
        if not op.ok:
            continue
        if op.kind == "step" and "expected" in op.args and op.digest != op.args["expected"]:
            found.append(Violation(
                "a", op.session, f"step {op.step} answered again with another output "
                f"({op.args['expected']} then {op.digest})", [op],
            ))  # fmt: skip
        if op.kind in ("get", "forecast") and "expect" in op.args and op.client != "observer":
            least = op.args["expect"] if op.args["durability"] == "log" else op.args["floor"]
            if op.step < least and op.step != op.args.get("pending_rollback"):
                found.append(Violation(
                    "a", op.session, f"a {op.kind} answered at step {op.step}, behind "
                    f"acknowledged step {least} ({op.args['durability']} durability)",
                    [*_ops_of_step(history, op.session, least), op],
                ))  # fmt: skip
    return found


#: The kinds of op that answer one step: a streamed step, a generated token.
ANSWERED_STEPS = ("step", "token")


def _ops_of_step(history: History, sid: str, step: int) -> list[Op]:
    return [
        o for o in history.ops if o.session == sid and o.kind in ANSWERED_STEPS and o.step == step
    ]


# ---------------------------------------------------------------------------- (b)


def check_ownership(history: History) -> list[Violation]:
    acquired: dict[tuple[str, str], list[float]] = defaultdict(list)  # (sid, worker) -> times
    for t in history.tokens:
        if t.source.startswith("log:"):
            acquired[(t.session, t.owner)].append(t.at)
    for times in acquired.values():
        times.sort()
    answers: dict[str, list[Op]] = defaultdict(list)
    for op in history.ops:
        if op.ok and op.kind in OWNER_ANSWERS and op.worker and op.complete is not None:
            answers[op.session].append(op)
    found: list[Violation] = []
    for sid, ops in answers.items():
        by_complete = sorted(ops, key=lambda o: o.complete or 0.0)
        done = 0
        # the newest-invoked answer completed so far, per worker
        newest: dict[str, Op] = {}
        for op in sorted(ops, key=lambda o: o.invoke):
            while done < len(by_complete) and (by_complete[done].complete or 0.0) < op.invoke:
                b = by_complete[done]
                if b.worker not in newest or newest[b.worker].invoke < b.invoke:
                    newest[b.worker] = b
                done += 1
            times = acquired.get((sid, op.worker), [])
            k = bisect.bisect_right(times, (op.complete or 0.0) + SLACK_S)
            last = times[k - 1] if k else float("-inf")
            for worker, other in newest.items():
                if worker != op.worker and last < other.invoke - SLACK_S:
                    found.append(Violation(
                        "b", sid, f"{op.worker} answered {op.kind} step {op.step} after "
                        f"{worker} had answered {other.kind} step {other.step}, with no "
                        f"acquisition of its own since (its last: "
                        f"{'never' if not k else f'{last:.3f}'})", [other, op],
                    ))  # fmt: skip
                    break
            else:
                continue
            break  # one per session: the first shows it
    return found


# ---------------------------------------------------------------------------- (c)


def check_tokens(tokens: list[TokenSighting]) -> list[Violation]:
    found: list[Violation] = []
    holders: dict[str, set[str]] = defaultdict(set)
    first_seen: dict[str, TokenSighting] = {}
    for t in tokens:
        if t.source.startswith("log:"):
            holders[t.token].add(t.source.split(":")[1])
            first_seen.setdefault(t.token, t)
    for token, procs in holders.items():
        if len(procs) > 1:
            t = first_seen[token]
            found.append(Violation(
                "c", t.session, f"token {token} was acquired by {len(procs)} worker processes "
                f"({', '.join(sorted(procs))})",
            ))  # fmt: skip
    owners: dict[str, TokenSighting] = {}
    for t in sorted((t for t in tokens if t.source == "redis"), key=lambda t: t.at):
        if t.owner.startswith(HANDOFF) or not t.owner:
            # The source's token reserved for a hand-off's target, or a session released
            # (parked, unloaded) keeping its last token: neither is a second owner.
            continue
        first = owners.setdefault(t.token, t)
        if first.owner != t.owner:
            found.append(Violation(
                "c", t.session, f"Redis shows token {t.token} held by {first.owner} at "
                f"{first.at:.3f} and by {t.owner} at {t.at:.3f}",
            ))  # fmt: skip
    return found


def rewinds(tokens: list[TokenSighting]) -> list[str]:
    """Each time Redis showed a session's token go back to one it had before: the store
    lost writes (what a run with failovers may see; the durability rule says whether an
    acknowledged step went with them)."""
    return [
        f"{at:.3f} session {sid}: token back to an earlier one"
        for sid, times in _store_losses(tokens).items()
        for at in times
    ]


# ---------------------------------------------------------------------------- (d), (e)


def check_ends(history: History) -> list[Violation]:
    found: list[Violation] = []
    for op in history.ops:
        if op.ok is None:
            found.append(Violation("d", op.session, f"request #{op.id} never ended", [op]))
        elif op.error.startswith("Hung"):
            found.append(Violation("d", op.session, f"request #{op.id} hung", [op]))
    return found


def check_recovery(history: History) -> list[Violation]:
    """Rule (e); a session the final read finds gone after the store was wiped went
    with the wipe (documented), even if its client never learnt it."""
    wiped = any(f.kind == "redis-restart-wiped" for f in history.faults)
    return [
        Violation("e", op.session, f"no answer after the faults stopped: {op.error}", [op])
        for op in history.ops
        if op.kind == "final"
        and not op.ok
        and not (wiped and op.error.startswith(("NotFound", "DataLoss")))
    ]


# ---------------------------------------------------------------------------- report


def stretch(history: History, v: Violation, limit: int = 40) -> list[str]:
    """The shortest stretch of history that shows ``v``: its ops, and between the first
    one's invocation and the last one's completion the session's other requests and
    every fault under way, in time order."""
    if not v.ops:  # a fact of the end state: the session's last requests and tokens
        mine = [(o.invoke, f"   {o.line()}") for o in history.ops if o.session == v.session]
        mine += [
            (t.at, f"   TOKEN {t.at:.3f} {t.token[-24:]} by {t.owner} ({t.source})")
            for t in history.tokens
            if t.session == v.session
        ]
        mine.sort(key=lambda x: x[0])
        return [s for _, s in mine[-limit:]] or ["   (no request of this session recorded)"]
    lo = min(o.invoke for o in v.ops)
    hi = max(o.complete or o.invoke for o in v.ops)
    shown: list[tuple[float, str]] = []
    for o in history.ops:
        if o in v.ops or (o.session == v.session and lo <= o.invoke <= hi):
            mark = ">>" if o in v.ops else "  "
            shown.append((o.invoke, f"{mark} {o.line()}"))
    faults: list[Fault] = [f for f in history.faults if f.start <= hi and (f.end or hi) >= lo]
    shown += [(f.start, f"   {f.line()}") for f in faults]
    for t in history.tokens:
        if t.session == v.session and lo - 1 <= t.at <= hi:
            shown.append((t.at, f"   TOKEN {t.at:.3f} {t.token[-24:]} by {t.owner} ({t.source})"))
    shown.sort(key=lambda x: x[0])
    lines = [s for _, s in shown]
    if len(lines) > limit:
        keep = [s for s in lines if s.startswith(">>")]
        rest = [s for s in lines if not s.startswith(">>")]
        lines = keep + rest[: max(0, limit - len(keep))] + [f"   ... {len(shown) - limit} more"]
    return lines
