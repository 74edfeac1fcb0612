"""The import graph points down the layers: no cycles, deferred (function-level) imports included.

Each top-level module or package of ``ftexp`` is one component; ``LAYERS`` lists them bottom-up,
and every import — at module level or inside a function — must go to the same component or one
further down. Inside a component, modules must not import each other in a cycle either.
"""

import ast
import re
from pathlib import Path

import ftexp

ROOT = Path(ftexp.__file__).parent
# Bottom-up. A component may import only itself and those before it.
LAYERS = ["errors", "missing", "environment", "atomic_files", "http_client", "store", "forkserver", "rundir", "control",
          "faults", "config", "placement", "audit", "verify", "engines", "job", "tasks", "rollout", "trainer", "scenarios", "launch",
          "tracking", "validate", "pipeline", "cli", "__main__"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """ftexp module -> the ftexp modules it imports anywhere in its body."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if "conf" in path.relative_to(ROOT).parts[:1]:
            continue
        name, targets = _module_name(path), set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # ``from pkg import mod`` imports the submodule when there is one.
                targets |= {f"{base}.{a.name}" if (ROOT.parent / f"{base}.{a.name}".replace(".", "/")).exists()
                            or (ROOT.parent / (f"{base}.{a.name}".replace(".", "/") + ".py")).exists() else base
                            for a in node.names}
        graph[name] = {t for t in targets if t == "ftexp" or t.startswith("ftexp.")}
    return graph


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_points_down_the_layers():
    up = []
    for src, targets in _imports().items():
        s = _component(src)
        for dst in targets:
            d = _component(dst)
            if d == "__init__" or s == d:
                continue
            assert s in LAYERS and d in LAYERS, f"{src} -> {dst}: add the component to LAYERS"
            if LAYERS.index(d) > LAYERS.index(s):
                up.append(f"{src} -> {dst}")
    assert up == [], "imports pointing up the layers:\n" + "\n".join(sorted(up))


def test_no_import_cycles_between_modules():
    graph = _imports()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_trainer_has_no_engine_switch():
    """Which engine runs is the registry's business: the fault-tolerant runtime only sees the protocol."""
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "trainer").rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "Engine." in line or re.search(r"ftexp\.engines\.(megatron|torch)", line)]
    assert offenders == []
