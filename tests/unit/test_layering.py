"""Imports point one way: every module's imports (module level and inside functions) obey the layer rules.

Layers, top to bottom (a layer may import itself and anything below it, never above):

    runtime.entrypoints (+ runtime.engine, runtime.launch_server, the `runtime` package facade)
    runtime.managers
    runtime.model_executor
    runtime.server_args (the options: it takes `--quantization`'s methods from runtime.models)
    runtime.models, runtime.mem_cache, radixlm_kernels
    shared top-level runtime modules: platform, sampling_params, messages, ipc, errors, cache_dir, allocator,
    tenants

plus these package rules: `constrained` imports nothing of ours (any runtime layer may use it);
`runtime.mem_cache` imports only the standard library and torch; `radixlm_kernels` imports nothing of
`runtime`; `lang` imports only `runtime.sampling_params` of ours; no package imports `bench` or `tests`.

Rules are per package, so a new module in an existing subpackage falls under them without editing this
file; a new top-level `runtime/*.py` module must be placed in LAYER_OF below. Imports under
`if TYPE_CHECKING:` are type-only and exempt.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "radixlm_kernels", "constrained", "lang")
OURS = (*PACKAGES, "bench", "tests")

SHARED = ("platform", "sampling_params", "messages", "ipc", "errors", "cache_dir", "allocator", "tenants")
# component of a `runtime` module, by its first name below `runtime`
LAYER_OF = {
    "entrypoints": "entrypoints",
    "engine": "entrypoints",
    "launch_server": "entrypoints",  # `python -m runtime.launch_server` / `radixlm serve`
    "": "entrypoints",  # the `runtime` package itself (lazy facade over Engine & co)
    "managers": "managers",
    "model_executor": "model_executor",
    "models": "models",
    "mem_cache": "mem_cache",
    "server_args": "server_args",
    **{name: "shared" for name in SHARED},
}
# component -> components of ours it may import (always including itself)
ALLOWED = {
    "entrypoints": {
        "entrypoints",
        "managers",
        "model_executor",
        "server_args",
        "models",
        "mem_cache",
        "radixlm_kernels",
        "shared",
        "constrained",
    },
    "managers": {
        "managers",
        "model_executor",
        "server_args",
        "models",
        "mem_cache",
        "radixlm_kernels",
        "shared",
        "constrained",
    },
    "model_executor": {
        "model_executor",
        "server_args",
        "models",
        "mem_cache",
        "radixlm_kernels",
        "shared",
        "constrained",
    },
    # models never read the server's options (they get plain arguments), so models and kernels stay usable
    # without the CLI; the options may name what the models offer (`--quantization`'s methods)
    "server_args": {"server_args", "models", "mem_cache", "radixlm_kernels", "shared", "constrained"},
    "models": {"models", "mem_cache", "radixlm_kernels", "shared", "constrained"},
    "mem_cache": {"mem_cache", "shared"},  # cache_dir: the disk tier's directory and file checks
    "shared": {"shared"},
    "radixlm_kernels": {"radixlm_kernels"},
    "constrained": {"constrained"},
    "lang": {"lang", "runtime.sampling_params"},
}
MEM_CACHE_THIRD_PARTY = {"torch"}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    source: str  # importing module
    target: str  # imported module
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} -> {self.target}: {self.why}"


def component(module: str) -> str | None:
    """The rule group of one of our modules ('managers', 'constrained', ...); None for third-party ones."""
    top, _, rest = module.partition(".")
    if top != "runtime":
        return top if top in OURS else None
    first = rest.partition(".")[0]
    if first not in LAYER_OF:
        raise KeyError(f"runtime module {module!r} is in no layer: add {first!r} to LAYER_OF")
    return LAYER_OF[first]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(tree: ast.AST, module: str, is_package: bool, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported module) for every run-time import, in functions too; `if TYPE_CHECKING:` bodies are
    skipped. `from pkg import name` counts as `pkg.name` when that is one of our modules, else as `pkg`."""
    found: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub, root) else mod))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def check_source(path: Path, source: str, root: Path = ROOT) -> list[Violation]:
    module = module_name(path, root)
    src_comp = component(module)
    rel = str(path.relative_to(root))
    out = []
    tree = ast.parse(source, filename=rel)
    for line, target in dict.fromkeys(imports_of(tree, module, path.name == "__init__.py", root)):
        top = target.partition(".")[0]
        tgt_comp = component(target)
        if tgt_comp is None:  # third-party or standard library
            if src_comp == "mem_cache" and top not in sys.stdlib_module_names | MEM_CACHE_THIRD_PARTY:
                out.append(Violation(rel, line, module, target, "mem_cache may import only stdlib + torch"))
            continue
        allowed = ALLOWED[src_comp]
        if tgt_comp in allowed or target in allowed:
            continue
        out.append(
            Violation(
                rel, line, module, target, f"{src_comp} may import only {', '.join(sorted(allowed))} of ours"
            )
        )
    return out


def package_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_package_files_found():
    files = {str(p.relative_to(ROOT)) for p in package_files()}
    expected = {
        "runtime/managers/scheduler/scheduler.py",
        "radixlm_kernels/base.py",
        "constrained/spec.py",
        "lang/api.py",
    }
    assert expected <= files


def test_imports_point_one_way():
    violations = []
    for path in package_files():
        violations += check_source(path, path.read_text(encoding="utf-8"))
    assert not violations, "upward or forbidden imports:\n" + "\n".join(map(str, violations))


# ---- the checker itself catches what it must (synthetic sources, real layout) --------------------------
def _check(rel: str, source: str) -> list[str]:
    return [str(v) for v in check_source(ROOT / rel, source)]


@pytest.mark.parametrize(
    ("rel", "source", "edge"),
    [
        (
            "runtime/models/llama.py",
            "from runtime.model_executor.forward_batch import ForwardBatch",
            "models",
        ),
        ("runtime/managers/x.py", "def f():\n    from runtime.entrypoints import server\n", "managers"),
        ("runtime/mem_cache/x.py", "import numpy", "mem_cache may import only stdlib + torch"),
        ("runtime/mem_cache/x.py", "from runtime.managers.scheduler.req import Req", "mem_cache"),
        ("radixlm_kernels/x.py", "from runtime.mem_cache.memory_pool import KVPool", "radixlm_kernels"),
        ("constrained/x.py", "import runtime.sampling_params", "constrained"),
        ("lang/x.py", "from runtime.engine import Engine", "lang"),
        ("runtime/sampling_params.py", "from runtime.managers import req", "shared"),
        ("runtime/platform.py", "from runtime.server_args import ServerArgs", "shared"),
        ("runtime/models/quantization.py", "from runtime.server_args import ServerArgs", "models"),
        ("runtime/server_args.py", "from runtime.model_executor import sampler", "server_args"),
        ("runtime/managers/x.py", "from bench import common", "managers"),
        ("runtime/managers/x.py", "import runtime", "managers"),
        ("runtime/managers/x.py", "from ..entrypoints import server", "managers"),
    ],
)
def test_checker_flags_forbidden_edges(rel, source, edge):
    found = _check(rel, source)
    assert len(found) == 1, found
    assert found[0].startswith(f"{rel}:") and edge in found[0], found


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        (
            "runtime/models/llama.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import runtime.engine",
        ),
        ("runtime/managers/x.py", "from runtime import ipc\nfrom runtime.model_executor import sampler"),
        ("runtime/mem_cache/x.py", "import heapq\nimport torch\nfrom runtime.mem_cache import memory_pool"),
        ("lang/x.py", "from runtime.sampling_params import SamplingParams"),
        ("runtime/engine.py", "from runtime.entrypoints.generate_input import parse_generate_body"),
        ("runtime/models/x.py", "from radixlm_kernels.base import AttentionBackend\nimport constrained"),
        (
            "runtime/server_args.py",
            "from runtime.models.quantization import QUANTIZATION_METHODS\nimport runtime.platform",
        ),
    ],
)
def test_checker_allows_permitted_edges(rel, source):
    assert _check(rel, source) == []


def test_checker_skips_only_the_type_checking_branch():
    src = "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import runtime.engine\n"
    found = _check("runtime/models/x.py", src)
    assert len(found) == 1 and ":5: runtime.models.x -> runtime.engine" in found[0], found


def test_unplaced_top_level_runtime_module_is_an_error():
    with pytest.raises(KeyError, match="add 'brand_new' to LAYER_OF"):
        _check("runtime/brand_new.py", "import os")


def test_runtime_types_satisfy_the_kernel_protocols():
    """radixlm_kernels/base.py spells out what backends read of runtime's objects; these must keep
    providing it."""
    import torch

    from radixlm_kernels.base import AttentionBatch, PagedKV, ReqToTokenTable
    from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool
    from runtime.model_executor.forward_batch import ForwardBatch

    batch = ForwardBatch.build_decode([5], [3], [0], torch.tensor([7]))
    assert isinstance(batch, AttentionBatch) and batch.is_decode and batch.batch_size == 1
    assert isinstance(KVPool(8, 1, 2, 4, torch.float32), PagedKV)
    assert isinstance(ReqToTokenPool(2, 16), ReqToTokenTable)
    assert not isinstance(object(), AttentionBatch)
