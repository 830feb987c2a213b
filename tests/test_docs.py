"""The docs run: every fenced code block of the README, BENCHMARKS.md, SECURITY.md and
docs/*.md is run, checked or explicitly marked as not run, so the docs cannot drift from
the code (docs/development.md, "The docs are tested").

* ```python blocks run as scripts, each in a fresh interpreter, against a real worker on a
  real redis-server (one for the whole module, plus a second worker for the cluster page).
  The docs' addresses (``localhost:50051``, ``localhost:50052``, the metrics endpoint
  ``localhost:9400``) are replaced by those of the test's workers; nothing else changes.
* ```bash blocks run with ``bash -euo pipefail`` in a fresh scratch directory, with the
  venv's ``bin`` first on PATH, the same addresses replaced and a timeout; exit status 0
  is the test.
* ```redis blocks are sent to the test's Redis, one command per block.
* ```text/toml/json/yaml blocks are shown, not run; the structured ones must parse.
* ``<!-- not run: why -->`` right before a block leaves it out (listed by
  ``test_blocks_not_run_are_marked_with_a_reason``); ``<!-- synopsis: ... -->`` marks a
  command synopsis, whose commands and flags are checked against the real parsers.

Beyond the blocks: the flags, commands, environment variables and metrics of the code
are all documented; relative links and anchors resolve; Markdown tables are well formed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import yaml

from ssmserve.server.http.listener import HttpSettings
from tests.harness import WorkerHarness
from tests.http_models import write_chat_model

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = [
    REPO / "README.md",
    REPO / "BENCHMARKS.md",
    REPO / "SECURITY.md",
    *sorted(DOCS.glob("*.md")),
]
RUN = {"python", "bash", "redis"}
SHOWN = {"text", "toml", "json", "yaml"}
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
SYNOPSIS = re.compile(r"^<!--\s*synopsis\b.*-->$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(.*)$")
#: What a block may take; the README's Python example streams in well under a second.
BLOCK_TIMEOUT_S = 180
#: The docs' addresses, stood in for by the test's worker (first), a second worker of
#: the same Redis, and the first worker's metrics endpoint.
FIRST, SECOND, METRICS = "localhost:50051", "localhost:50052", "localhost:9400"
HTTP = "localhost:8000"  # the first worker's --http (serving a "chat" model: docs/http.md)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason given, or None
    synopsis: bool

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def _lines_outside_code(text: str) -> Iterator[tuple[int, str]]:
    fence = ""
    for number, line in enumerate(text.split("\n"), 1):
        match = FENCE.match(line)
        if match and (not fence or match.group(2).startswith(fence)):
            fence = "" if fence else match.group(2)
            continue
        if not fence:
            yield number, line


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        ]
        before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        reason = NOT_RUN.match(before)
        blocks.append(
            Block(
                page=page,
                line=i + 1,
                language=info.split()[0] if info.split() else "",
                code="\n".join(body) + "\n",
                not_run=reason.group(1) if reason else None,
                synopsis=bool(SYNOPSIS.match(before)),
            )
        )
        i = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]
RUNNABLE = [b for b in ALL_BLOCKS if b.language in RUN and b.not_run is None and not b.synopsis]
SYNOPSES = [b for b in ALL_BLOCKS if b.synopsis]


def _param(block: Block) -> object:
    # The README is what a newcomer runs first: always. The other pages' command tours
    # start a CLI process per line (about a second each): with the slow runs.
    slow = block.language == "bash" and block.page.name != "README.md"
    return pytest.param(block, id=block.name, marks=[pytest.mark.slow] if slow else [])


# ---------------------------------------------------------------------------- the workers


@dataclass(frozen=True)
class DocsWorld:
    first: WorkerHarness
    second: WorkerHarness
    redis_url: str

    def substitute(self, code: str) -> str:
        for placeholder, real in (
            (FIRST, self.first.address),
            ("127.0.0.1:50051", self.first.address),
            (SECOND, self.second.address),
            (METRICS, self.first.worker.metrics_address),
            (HTTP, self.first.worker.http_door.address),
        ):
            code = code.replace(placeholder, real)
        return code


@pytest.fixture(scope="module")
def world(model_dirs, redis_server, tmp_path_factory) -> Iterator[DocsWorld]:
    with redis.Redis.from_url(redis_server.url) as conn:
        conn.flushall()
    chat = tmp_path_factory.mktemp("docs-chat") / "chat"
    write_chat_model(chat)
    first = WorkerHarness(
        {**model_dirs, "chat": chat}, redis_server.url, metrics_listen="127.0.0.1:0",
        http=HttpSettings(listen="127.0.0.1:0"),
    )  # fmt: skip
    second = WorkerHarness(model_dirs, redis_server.url)
    try:
        yield DocsWorld(first, second, redis_server.url)
    finally:
        second.stop()
        first.stop()


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SSMSERVE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["SSMSERVE_LOG_LEVEL"] = "WARNING"
    return env


def _run(argv: list[str], cwd: Path, block: Block) -> None:
    try:
        done = subprocess.run(
            argv, cwd=cwd, env=_environment(), capture_output=True, text=True,
            timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.name}: still running after {BLOCK_TIMEOUT_S} s\n{exc.stdout}")
    assert done.returncode == 0, (
        f"{block.name} ({block.language}) exited with {done.returncode}\n"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )


@pytest.mark.parametrize("block", [_param(b) for b in RUNNABLE])
def test_block_runs(block: Block, world: DocsWorld, tmp_path: Path) -> None:
    code = world.substitute(block.code)
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        _run([sys.executable, str(script)], tmp_path, block)
    elif block.language == "bash":
        _run(["bash", "-euo", "pipefail", "-c", code], tmp_path, block)
    else:
        command = shlex.split(" ".join(code.split()))
        with redis.Redis.from_url(world.redis_url) as conn:
            conn.execute_command(*command)
            if [w.upper() for w in command[:2]] == ["ACL", "SETUSER"]:
                conn.execute_command("ACL", "DELUSER", command[2])


# ---------------------------------------------------------------------------- every block


def test_every_block_says_what_it_is() -> None:
    """A block runs, is shown (text and data), or says why it does not run."""
    wrong = [
        f"{b.name}: language {b.language!r}" for b in ALL_BLOCKS if b.language not in RUN | SHOWN
    ]
    wrong += [f"{b.name}: 'not run' without a reason" for b in ALL_BLOCKS if b.not_run == ""]
    wrong += [f"{b.name}: a synopsis that is not bash" for b in SYNOPSES if b.language != "bash"]
    assert not wrong, (
        "blocks must be python, bash or redis (run), or text, toml, json or yaml:\n"
        + "\n".join(wrong)
    )


def test_blocks_not_run_are_marked_with_a_reason() -> None:
    not_run = [b for b in ALL_BLOCKS if b.not_run is not None]
    for b in not_run:
        print(f"not run: {b.name} ({b.language}): {b.not_run}")
    print(
        f"{len(RUNNABLE)} blocks run, {len(SYNOPSES)} synopses checked, {len(not_run)} not "
        f"run, {len(ALL_BLOCKS) - len(RUNNABLE) - len(SYNOPSES) - len(not_run)} shown"
    )
    assert RUNNABLE and all(b.not_run for b in not_run)


def test_structured_blocks_parse() -> None:
    readers = {"toml": tomllib.loads, "json": json.loads, "yaml": yaml.safe_load}
    for b in ALL_BLOCKS:
        if b.language in readers:
            readers[b.language](b.code)


# ---------------------------------------------------------------------------- the parsers


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from ssmserve.client.cli import build_parser as client_parser
    from ssmserve.server.main import build_parser as server_parser

    return {"ssmserve": client_parser(), "ssmserve-server": server_parser()}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options ``--help`` shows (a hidden, deprecated spelling is no option of the docs)."""
    return {
        s: a
        for a in parser._actions
        for s in a.option_strings
        if s not in ("-h", "--help") and a.help != argparse.SUPPRESS
    }


def _hidden_options(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            yield from action.option_strings
    for child in _subcommands(parser).values():
        yield from _hidden_options(child)


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    children = _subcommands(parser)
    if not children:
        yield path
    for name, child in children.items():
        yield from _leaves(child, (*path, name))


def _commands(block: Block) -> list[str]:
    """The block's commands, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", block.code)
    commands: list[str] = []
    for line in joined.split("\n"):
        if not line.strip():
            continue
        if line[0].isspace() and commands:
            commands[-1] += " " + line.strip()
        else:
            commands.append(line.strip())
    return commands


def _resolve(command: str) -> tuple[str, tuple[str, ...], set[str]]:
    """(program, command path, flags) of one synopsis line; fails on what the parsers
    do not know."""
    parsers = _parsers()
    tokens = re.findall(r"[^\s\[\]()|]+", command)
    program = tokens[0]
    assert program in parsers, f"{command!r}: not ssmserve or ssmserve-server"
    parser = root = parsers[program]
    path: list[str] = []
    rest = iter(tokens[1:])
    flags: set[str] = set()
    for token in rest:
        children = _subcommands(parser)
        if token.startswith("--"):
            flag = re.match(r"--[a-z0-9][a-z0-9-]*", token)
            assert flag, f"{command!r}: {token!r}"
            known = _options(parser) | (_options(root) if not path else {})
            assert flag.group(0) in known, (
                f"{command!r}: no {flag.group(0)} in {program} {' '.join(path)}"
            )
            flags.add(flag.group(0))
            if (
                not path
                and flag.group(0) in _options(root)
                and _options(root)[flag.group(0)].nargs != 0
            ):
                next(rest, None)  # a global option's value
        elif children and re.fullmatch(r"[a-z][a-z0-9-]*", token):
            assert token in children, (
                f"{command!r}: no command {token!r} in {program} {' '.join(path)}"
            )
            parser = children[token]
            path.append(token)
    assert not _subcommands(parser), f"{command!r}: {program} {' '.join(path)} needs a command"
    return program, tuple(path), flags


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in SYNOPSES])
def test_synopsis_names_real_commands_and_flags(block: Block) -> None:
    for command in _commands(block):
        _resolve(command)


def test_every_command_and_flag_has_its_synopsis() -> None:
    """docs/cli.md names every command of ``ssmserve`` with every flag it takes, and
    docs/serving.md every flag of ``ssmserve-server``."""
    documented: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    for block in SYNOPSES:
        if block.page.name in ("cli.md", "serving.md"):
            for command in _commands(block):
                program, path, flags = _resolve(command)
                documented.setdefault((program, path), set()).update(flags)
    missing = []
    for program, root in _parsers().items():
        for path in _leaves(root):
            parser = root
            for name in path:
                parser = _subcommands(parser)[name]
            wanted = set(_options(parser)) - (set(_options(root)) if path else set())
            if (program, path) not in documented:
                missing.append(f"{program} {' '.join(path)}: no synopsis")
            elif wanted - documented[(program, path)]:
                missing.append(
                    f"{program} {' '.join(path)}: {sorted(wanted - documented[(program, path)])}"
                )
    assert not missing, "undocumented:\n" + "\n".join(missing)
    cli = (DOCS / "cli.md").read_text()
    assert all(flag in cli for flag in _options(_parsers()["ssmserve"])), "global options"


def test_no_deprecated_spelling_is_documented() -> None:
    hidden = {flag for parser in _parsers().values() for flag in _hidden_options(parser)}
    text = _docs_text()
    used = sorted(f for f in hidden if re.search(re.escape(f) + r"(?![\w-])", text))
    assert not used, f"deprecated flags in the docs: {used}"


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in PAGES)


def test_every_environment_variable_is_documented() -> None:
    sources = [*(REPO / "server").rglob("*.py"), *(REPO / "client" / "ssmserve").rglob("*.py")]
    names = {n for p in sources for n in re.findall(r"SSMSERVE_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    text = _docs_text()
    assert not sorted(n for n in names if n not in text)


def test_every_metric_is_documented() -> None:
    sources = (REPO / "server" / "ssmserve" / "server").rglob("*.py")
    names = {n for p in sources for n in re.findall(r"\"(ssmserve_[a-z_]+)\"", p.read_text())}
    page = (DOCS / "observability.md").read_text()
    assert names and not sorted(n for n in names if n not in page)


# ---------------------------------------------------------------------------- links, tables


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {
        _slug(line.lstrip("#"))
        for _, line in _lines_outside_code(page.read_text())
        if re.match(r"^#{1,6} ", line)
    }


def test_links_and_anchors_resolve() -> None:
    broken = []
    for page in PAGES:
        for number, line in _lines_outside_code(page.read_text()):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                if not file.exists():
                    broken.append(f"{page.name}:{number}: {target} (no such file)")
                elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                    broken.append(f"{page.name}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_tables_are_well_formed() -> None:
    """A table is a header, a separator and rows of as many cells: a blank line or a row
    with a stray pipe would end it or shift its columns."""
    wrong = []
    for page in PAGES:
        table: list[tuple[int, str]] = []
        for number, line in [*_lines_outside_code(page.read_text()), (0, "")]:
            if line.startswith("|"):
                table.append((number, line))
                continue
            if table:
                cells = [len(re.findall(r"(?<!\\)\|", row)) for _, row in table]
                if len(table) < 2 or not re.fullmatch(r"\|( *:?-+:? *\|)+", table[1][1].strip()):
                    wrong.append(f"{page.name}:{table[0][0]}: no separator line")
                elif len(set(cells)) != 1:
                    wrong.append(f"{page.name}:{table[0][0]}: rows of {sorted(set(cells))} pipes")
                table = []
    assert not wrong, "\n".join(wrong)
