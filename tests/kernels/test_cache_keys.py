"""The kernels' cache keys do not depend on which kernel a process hashed first.

Triton (3.6, the GPU image's) folds the module-level constexprs a JIT function reads into its cache key, and a
caller's key takes in those of the helpers it calls only if the helper was hashed before it. So a helper that
reads a module-level constexpr gives its callers one key in a process that hashed the helper first (through
another kernel) and another where the caller came first: the compile pool's workers then write programs under
keys the service does not look up, and a warm restart misses its own cache. The rule this checks: a JIT function
that other JIT functions call reads no module-level constexpr (it takes a constexpr argument, or a
`triton.constexpr_function` computes the value); kernels that nothing calls may read them.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from types import ModuleType

import pytest

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


def _jit_functions() -> dict[str, object]:
    """Every JIT (or constexpr) function of the kernels package, compiled or interpreted, by module.name (each
    once, where it is defined)."""
    import kernels

    found: dict[str, object] = {}
    for info in pkgutil.iter_modules(kernels.__path__, "kernels."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and fn.__name__ == name:
                found[f"{module.__name__}.{name}"] = obj
    return found


def _globals_read(obj: object) -> list[tuple[str, object]]:
    """(name as written, value) of each module-level name (or module attribute) the function's body reads."""
    fn = obj.fn  # type: ignore[attr-defined]
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    params = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    read: list[tuple[str, object]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and isinstance(fn.__globals__.get(node.value.id), ModuleType):
            module = fn.__globals__[node.value.id]
            if hasattr(module, node.attr):
                read.append((f"{node.value.id}.{node.attr}", getattr(module, node.attr)))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in params | stored \
                and node.id in fn.__globals__:
            read.append((node.id, fn.__globals__[node.id]))
    return read


def test_no_helper_reads_a_module_level_constexpr():
    functions = _jit_functions()
    assert len(functions) > 50                                # the package's kernels and helpers were found
    by_id = {id(obj): name for name, obj in functions.items()}
    callers: dict[str, list[str]] = {}
    for name, obj in functions.items():
        for _, value in _globals_read(obj):
            callee = by_id.get(id(value))
            if callee is not None and callee != name:
                callers.setdefault(callee, []).append(name)
    assert "kernels.dots._dot" in callers                     # the call graph was found
    offending = [f"{name} reads {read} (called by {', '.join(sorted(set(callers[name]))[:3])})"
                 for name in sorted(callers) for read, value in _globals_read(functions[name])
                 if isinstance(value, tl.constexpr)]
    assert not offending, "helpers reading module-level constexprs:\n" + "\n".join(offending)


_FLAG = tl.constexpr(True)


def _reads_flag(x):
    if _FLAG:
        x = x + 1
    return x


def test_the_check_sees_a_function_that_reads_one():
    reads = _globals_read(type("Jit", (), {"fn": staticmethod(_reads_flag)})())
    assert reads == [("_FLAG", _FLAG)]
