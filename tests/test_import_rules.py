"""The import rules of docs/architecture.md, enforced: layers only import downwards, no circles.

Every ``import`` / ``from ... import`` in toolkit/ and model_adapters/ counts, also the ones inside
functions (a lazy import that runs back up is still an arrow back up). The layer table below is
the one in docs/architecture.md; change both together.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module may import its own package and the packages of lower layers.
LAYERS: list[tuple[str, ...]] = [
    ("toolkit.errors",),
    ("toolkit.atomic", "toolkit.bundled", "toolkit.eager_jit", "toolkit.jsonl", "toolkit.lazy",
     "toolkit.mapping",
     "toolkit.rules",
     "toolkit.runtime"),
    ("toolkit.parallel",),
    ("toolkit.checkpoint", "toolkit.models", "toolkit.testing"),
    ("toolkit.adapters",),
    ("model_adapters",),
    ("toolkit.lora",),
    ("toolkit.memory",),
    ("toolkit.dsconfig",),
    ("toolkit.planner",),
    ("toolkit.convert",),
    ("toolkit.infer",),
    ("toolkit.train",),
    ("toolkit.launch",),
    ("toolkit.demo",),
    ("toolkit.commands",),
    ("toolkit.cli",),
]
#: The half of the adapters package that needs neither torch nor transformers.
TORCH_FREE_ADAPTERS = ("toolkit.adapters", "toolkit.adapters.family", "toolkit.adapters.registry",
                       "toolkit.adapters.hfconfig", "toolkit.adapters.presets",
                       "toolkit.adapters.shape", "toolkit.adapters.spec",
                       "toolkit.adapters.hybrid")
#: Packages that must stay importable without torch see only that half (estimate / ds-config
#: start instantly; a family file is a declaration).
TORCH_FREE_USERS = ("model_adapters", "toolkit.memory", "toolkit.dsconfig")
#: The half of the LoRA package that needs no torch (what the memory model counts with).
TORCH_FREE_LORA = ("toolkit.lora", "toolkit.lora.spec", "toolkit.lora.targets",
                   "toolkit.lora.plan")
#: A family file declares; it may import only these (and its sibling families).
FAMILY_IMPORTS = TORCH_FREE_ADAPTERS + ("toolkit.mapping", "model_adapters")
#: The byte layer of checkpoints: besides the standard library it imports only itself,
#: ``toolkit.checkpoint`` (for CheckpointError) and the lazy torch proxy, so no path through it
#: imports torch, a format module or a third-party package.
BYTE_LAYER = "toolkit.checkpoint.torchfree"
BYTE_LAYER_IMPORTS = (BYTE_LAYER, "toolkit.lazy")


def package_of(module: str) -> str | None:
    for layer in LAYERS:
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                return pkg
    return None


def rank_of(pkg: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if pkg in layer)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            # `from toolkit import runtime` imports the submodule toolkit.runtime
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def sources() -> list[Path]:
    return sorted(p for d in ("toolkit", "model_adapters") for p in (ROOT / d).rglob("*.py"))


def is_module(name: str) -> bool:
    parts = name.split(".")
    return (ROOT.joinpath(*parts).with_suffix(".py").is_file()
            or (ROOT.joinpath(*parts) / "__init__.py").is_file())


def test_every_package_has_a_layer():
    loose = sorted({module_name(p) for p in sources() if package_of(module_name(p)) is None}
                   - {"toolkit", "model_adapters"})
    assert not loose, f"modules outside the layer table (add them to LAYERS and the doc): {loose}"


def test_layers_only_import_downwards():
    wrong = []
    for path in sources():
        mod = module_name(path)
        src = package_of(mod)
        if src is None:
            continue
        for line, target in imports(path):
            if not is_module(target):
                continue
            dst = package_of(target)
            if dst is None or dst == src:
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if rank_of(dst) > rank_of(src):
                wrong.append(f"{where} (upward: {src} is below {dst})")
            elif rank_of(dst) == rank_of(src):
                wrong.append(f"{where} (sideways within one layer: {src} / {dst})")
            if (src in TORCH_FREE_USERS and dst == "toolkit.adapters"
                    and target not in TORCH_FREE_ADAPTERS):
                wrong.append(f"{where} ({src} may use only {', '.join(TORCH_FREE_ADAPTERS)})")
            if (src in TORCH_FREE_USERS and dst == "toolkit.lora"
                    and target not in TORCH_FREE_LORA):
                wrong.append(f"{where} ({src} may use only {', '.join(TORCH_FREE_LORA)})")
            if (src == "toolkit.lora" and mod in TORCH_FREE_LORA and dst == "toolkit.adapters"
                    and target not in TORCH_FREE_ADAPTERS):
                wrong.append(f"{where} (the torch-free half of toolkit.lora may use only "
                             f"{', '.join(TORCH_FREE_ADAPTERS)})")
        if src == "model_adapters":
            for line, target in imports(path):
                parent = target.rpartition(".")[0]
                if parent and not is_module(target) and is_module(parent):
                    continue  # a name imported from a module: the module is checked
                inside = any(target == m or target.startswith(m + ".") for m in FAMILY_IMPORTS
                             if m != "toolkit.adapters") or target in TORCH_FREE_ADAPTERS
                stdlib = target.split(".")[0] in sys.stdlib_module_names
                if not inside and not stdlib:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (a family "
                                 f"file may import only {', '.join(FAMILY_IMPORTS)})")
    assert not wrong, "import rules of docs/architecture.md broken:\n" + "\n".join(wrong)


def test_byte_layer_imports_only_itself():
    wrong = []
    for path in sources():
        if not (module_name(path) + ".").startswith(BYTE_LAYER + "."):
            continue
        for line, target in imports(path):
            parent = target.rpartition(".")[0]
            inside = any(target == m or target.startswith(m + ".") for m in BYTE_LAYER_IMPORTS)
            package = target == "toolkit.checkpoint" or (
                parent == "toolkit.checkpoint" and not is_module(target))  # CheckpointError
            stdlib = target.split(".")[0] in sys.stdlib_module_names
            if not (inside or package or stdlib):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, ("checkpoint/torchfree/ may import only itself, toolkit.checkpoint's "
                       "CheckpointError, toolkit.lazy and the standard library:\n"
                       + "\n".join(wrong))


def test_production_code_does_not_import_the_test_helpers():
    """``toolkit.testing`` is for tests and scripts; what production code needs of it (the rank
    pool) lives in ``toolkit.runtime.rankpool``."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {target}"
             for path in sources() if package_of(module_name(path)) != "toolkit.testing"
             for line, target in imports(path)
             if target == "toolkit.testing" or target.startswith("toolkit.testing.")]
    assert not wrong, "production code imports toolkit.testing:\n" + "\n".join(wrong)


def test_no_module_import_circles():
    """No cycle among modules through module-level imports (what runs at import time)."""
    graph: dict[str, set[str]] = {}
    for path in sources():
        mod = module_name(path)
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        targets = {t for line, t in imports(path) if any(n.lineno == line for n in top)}
        graph[mod] = {t for t in targets if is_module(t) and t != mod}
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node)
    # A package's __init__ re-exporting its own submodules is not a circle between parts.
    cycles = [c for c in cycles if len({package_of(m) for m in c}) > 1 or
              not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)
