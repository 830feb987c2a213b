"""What Triton's compiler refuses and its interpreter (all CI has) accepts, read off the
kernels' source: a kernel that reads a module global which is not a ``tl.constexpr``.

The compiler fails such a kernel at its first launch on a GPU ("Cannot access global
variable ... from within @jit'ed function"); the interpreter runs it as plain Python. The
device check found one (``SOFTPLUS_THRESHOLD``) on its first run on an H200.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "server/ssmserve/server/engine/gpu/kernels.py"


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _is_constexpr(value: ast.expr) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "constexpr"
    )


def globals_read_by_kernels(source: str) -> dict[str, set[str]]:
    """Each @triton.jit function's reads of module-level values that are not constexprs."""
    tree = ast.parse(source)
    plain: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and not _is_constexpr(node.value):
            plain |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and (node.value is None or not _is_constexpr(node.value))
        ):
            plain.add(node.target.id)
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(map(_is_jit, node.decorator_list)):
            local = {a.arg for a in node.args.args}
            reads = {  # the body's, not the decorator's (host code)
                n.id
                for statement in node.body
                for n in ast.walk(statement)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            }
            bad = (reads - local) & plain
            if bad:
                found[node.name] = bad
    return found


def test_no_kernel_reads_a_global_that_is_not_a_constexpr():
    assert globals_read_by_kernels(KERNELS.read_text()) == {}


def test_the_check_finds_a_plain_global_and_lets_a_constexpr_through():
    source = (
        "import triton\nimport triton.language as tl\n"
        "LIMIT = 20.0\nOK = tl.constexpr(20.0)\n"
        "@triton.jit\ndef f(x):\n    return tl.minimum(x, LIMIT) + OK\n"
        "@triton.jit(do_not_specialize=['x'])\ndef g(x):\n    return x * LIMIT\n"
    )
    assert globals_read_by_kernels(source) == {"f": {"LIMIT"}, "g": {"LIMIT"}}
