"""The architecture as a test: which package may import which, and no import cycles.

``protocol`` <- ``draft_server``, ``protocol`` <- ``target_client``, all three <- ``draft_tools``.
The runtime never imports tooling; the client (it lives in the target engine's process) never
imports server or model code, nor torch at module level (torch only inside functions of the vLLM
plugin and of the CUDA IPC transport's device side). Every import counts, also the ones
inside functions; ``if TYPE_CHECKING`` blocks are the only exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "draft_server", "target_client", "draft_tools")
ALLOWED = {
    "protocol": {"protocol"},
    "draft_server": {"protocol", "draft_server"},
    "target_client": {"protocol", "target_client"},
    "draft_tools": set(PACKAGES),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import outside TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse, top)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                base = child.module
                for a in child.names:  # `from pkg import sub` may name a submodule
                    out.append((f"{base}.{a.name}", child.lineno, top))
            nested = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            visit(child, nested if not isinstance(child, ast.ClassDef) else top)

    visit(tree, True)
    return out


def _graph() -> tuple[dict[str, list[tuple[str, int, bool]]], set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, list[tuple[str, int, bool]]] = {}
    for name, path in modules.items():
        edges = []
        for target, line, top in _imports(path):
            while target and target not in modules:  # `from a.b import C` -> module a.b
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] in PACKAGES:
                edges.append((target, line, top))
        graph[name] = edges
    return graph, set(modules)


def test_dependencies_point_one_way() -> None:
    graph, _ = _graph()
    bad = [
        f"{src} imports {dst} (line {line})"
        for src, edges in graph.items()
        for dst, line, _ in edges
        if dst.split(".")[0] not in ALLOWED[src.split(".")[0]]
    ]
    assert not bad, "\n".join(bad)


def test_the_client_never_imports_torch_or_the_server() -> None:
    for path in (ROOT / "target_client").rglob("*.py"):
        for name, line, top in _imports(path):
            root = name.split(".")[0]
            assert root not in ("draft_server", "draft_tools"), f"{path}:{line} imports {name}"
            # the vLLM plugin runs inside vLLM, which has torch; the CUDA IPC transport's device side
            # (target_client/cuda) only runs in a client whose rows are torch CUDA tensors
            if path.parent.name not in ("vllm", "cuda"):
                assert root != "torch", f"{path}:{line} imports torch"
            elif root == "torch":
                assert not top, f"{path}:{line} imports torch at module level"


def test_no_import_cycles() -> None:
    graph, modules = _graph()
    adj = {m: sorted({dst for dst, _, _ in graph[m] if dst != m and dst in modules}) for m in modules}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in adj[m]:
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
