"""The repository's shape: imports, rooms, file sizes, top-level modules, tools/.

- every module of moe/ and megatron_gspo/ imports alone (no import circle that only a lucky
  import order hides);
- the import graph of the project's modules (module-level and function-level imports) has no
  cycle, moe never imports megatron_gspo, and no room of megatron_gspo imports a higher one
  (config < algo < tasks < rollout < run < jobs < cli; see each room's `__init__.py`; a
  sub-room such as rollout/vllm/ sits above the rest of its room);
- the script folders are layered too (tools < bench < experiments): each imports the project
  packages and lower folders only, so the result-table writer they share lives in tools/;
- few function-level imports in the packages and the script folders, each commented with why it
  is not at the module's top;
- no Python file over 400 lines; megatron_gspo/ has few top-level modules; tools/ holds only the
  user CLIs and the result-table writer they share;
- the CLI imports neither torch nor megatron-core before a job needs them.

Each check reads the tree under ROOT, so `check_*(root)` can be pointed at another tree.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "megatron_gspo")
ROOMS = ("config", "algo", "tasks", "rollout", "run", "jobs", "cli")
MOE_ROOMS = ("platform", "routing", "model", "inference", "hf")
"""moe/'s rooms, lowest first (moe/__init__.py says what each holds)."""
"""megatron_gspo's rooms, lowest first; the top-level helpers (errors, dist) sit below config."""
SUBROOMS = {"rollout": ("vllm",)}
"""Rooms inside a room of megatron_gspo: each sits above the rest of its room, which never
imports it (`rollout.backends` registers the vLLM backend by the path of its factory)."""
SCRIPTS = ("tools", "bench", "experiments")
"""The script folders, lowest first: user CLIs, benchmarks, experiments."""
MAX_FUNCTION_IMPORTS = 60
MAX_LINES = 400
MAX_TOP_LEVEL_MODULES = 6
TOOLS = {"__init__", "demo", "hf_parity", "make_fixtures", "plot_run", "replay_memory",
         "result_table", "train_memory", "plot_load"}
"""The user CLIs, and the helpers of one (result_table, plot_load: plot_run's)."""
SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}
PRELOADED = ("torch", "numpy", "yaml", "megatron")
"""Third-party packages `check_imports_alone` imports before forking (required ones only)."""


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the project packages (packages by __init__)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST):
    """(node, inside a function) for every import statement of a module."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            yield from walk(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef)))
    yield from walk(tree, False)


def _targets(name: str, path: Path, node, modules: dict) -> set[str]:
    """The project modules an import statement of module `name` loads (the deepest module a
    dotted name reaches; `from pkg import mod` counts as pkg.mod)."""
    def deepest(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    if isinstance(node, ast.Import):
        return {t for a in node.names if (t := deepest(a.name))}
    base = node.module or ""
    if node.level:  # relative: from the module's package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    out = set()
    for alias in node.names:
        full = f"{base}.{alias.name}"
        target = full if full in modules else deepest(base)
        if target:
            out.add(target)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Project module -> the project modules it imports (at module level or in a function)."""
    modules = project_modules(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            edges |= _targets(name, path, node, modules)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def room(module: str) -> float:
    """Rank of a module's room: moe's rooms in MOE_ROOMS order (all below megatron_gspo; the
    package `moe` itself with platform, whose import hook it runs), megatron_gspo's helpers 0,
    then ROOMS in order, a SUBROOMS room half a rank above the rest of its room."""
    parts = module.split(".")
    if parts[0] == "moe":
        name = parts[1] if len(parts) > 1 and parts[1] in MOE_ROOMS else MOE_ROOMS[0]
        return MOE_ROOMS.index(name) - len(MOE_ROOMS)
    if len(parts) == 1 or parts[1] not in ROOMS:
        return 0  # megatron_gspo, megatron_gspo.errors, megatron_gspo.dist
    inner = len(parts) > 2 and parts[2] in SUBROOMS.get(parts[1], ())
    return ROOMS.index(parts[1]) + 1 + (0.5 if inner else 0)


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if room(b) > room(a)]


def script_files(root: Path = ROOT):
    """(folder, file) of every Python file under the script folders."""
    for folder in SCRIPTS:
        yield from ((folder, path) for path in python_files(root / folder))


def script_violations(root: Path = ROOT) -> list[str]:
    """`file -> folder` for each import of a script folder by a lower one (tools < bench <
    experiments), module-level or in a function."""
    out = []
    for folder, path in script_files(root):
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top in SCRIPTS and SCRIPTS.index(top) > SCRIPTS.index(folder):
                    out.append(f"{path.relative_to(root)} -> {top}")
    return out


def function_imports(root: Path = ROOT) -> list[tuple[str, int, bool]]:
    """(file, line, commented) of every import inside a function of the project packages and
    the script folders. An import is commented when a comment is on one of its lines, or on the
    line above it or above the run of import statements it starts or continues (`try:` lines
    included)."""
    out = []
    files = [*project_modules(root).values(), *(path for _, path in script_files(root))]
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        found = [node for node, in_function in _imports(ast.parse(text)) if in_function]
        import_lines = {i for node in found for i in range(node.lineno, node.end_lineno + 1)}
        for node in found:
            own = any("#" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1))
            above = node.lineno - 1
            while above in import_lines:
                above -= 1
            commented = own or (above >= 1 and "#" in lines[above - 1])
            out.append((str(path.relative_to(root)), node.lineno, commented))
    return out


def python_files(root: Path = ROOT):
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                   and not d.endswith(".egg-info")]
        yield from (Path(folder) / f for f in files if f.endswith(".py"))


# ------------------------------------------------------------------------- the checks
def check_imports_alone(root: Path = ROOT) -> dict[str, str]:
    """Module -> error, for each project module that fails to import alone.

    Importing ~70 modules each in a new interpreter costs minutes (torch and megatron-core take
    seconds each time), so one interpreter imports the third-party packages the project imports
    at module level, plus `moe/__init__` (its import hook must precede megatron, and any moe
    module runs it first anyway), then forks one child per module: each child starts with no
    other project module imported."""
    modules = project_modules(root)
    third_party = set()
    for path in modules.values():
        for node, in_function in _imports(ast.parse(path.read_text())):
            if in_function or getattr(node, "level", 0):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            third_party |= {n for n in names if n.split(".")[0] in PRELOADED}
    script = textwrap.dedent(f"""
        import importlib, json, os, sys, traceback
        import moe
        hook = sorted(m for m in sys.modules if m.startswith("moe."))  # moe/__init__'s own
        for name in {sorted(third_party)!r}:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # a newer megatron-core's module (imported under try / except)
        early = sorted(m for m in sys.modules if m.startswith(("moe.", "megatron_gspo")))
        assert early == hook, f"imported before forking: {{early}}"
        failures = {{}}
        for name in {sorted(modules)!r}:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                try:
                    importlib.import_module(name)
                    status, message = 0, ""
                except BaseException:
                    status, message = 1, traceback.format_exc()[-1500:]
                os.write(write, message.encode())
                os._exit(status)
            os.close(write)
            with os.fdopen(read) as f:
                message = f.read()
            if os.waitpid(pid, 0)[1] != 0:
                failures[name] = message or "the child died"
        print(json.dumps(failures))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_module_imports_alone():
    failures = check_imports_alone()
    assert not failures, "\n".join(f"{name}:\n{error}" for name, error in failures.items())


def test_the_import_graph_has_no_cycle_and_rooms_import_only_lower_rooms():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 100  # the graph sees the project's imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert room_violations(graph) == []


def test_rollout_vllm_is_a_room_above_the_rest_of_rollout():
    """The vLLM backend lives in rollout/vllm/, which the rest of rollout/ never imports; beside
    it, rollout/ keeps only the older `python -m megatron_gspo.rollout.vllm_server` path."""
    up = {"megatron_gspo.rollout.backends": {"megatron_gspo.rollout.vllm.sampler"}}
    down = {"megatron_gspo.rollout.vllm.sampler": {"megatron_gspo.rollout.sampler"}}
    assert room_violations(up) == ["megatron_gspo.rollout.backends -> "
                                   "megatron_gspo.rollout.vllm.sampler"]
    assert room_violations(down) == []
    rollout = ROOT / "megatron_gspo" / "rollout"
    assert sorted(p.name for p in rollout.glob("vllm*.py")) == ["vllm_server.py"]
    assert len((rollout / "vllm_server.py").read_text().splitlines()) < 10  # a path, no code
    assert len(list((rollout / "vllm").glob("*.py"))) > 5


def test_script_folders_import_only_lower_ones():
    assert sum(1 for _ in script_files()) > 30  # the check sees the scripts
    assert script_violations() == []


def test_few_function_level_imports_each_commented():
    found = function_imports()
    uncommented = [f"{file}:{line}" for file, line, commented in found if not commented]
    assert len(found) < MAX_FUNCTION_IMPORTS, f"{len(found)} function-level imports"
    assert uncommented == [], "function-level imports without a comment saying why: " \
        + ", ".join(uncommented)


def test_no_python_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by topic: {long}"


def test_megatron_gspo_has_few_top_level_modules():
    top = sorted(p.stem for p in (ROOT / "megatron_gspo").glob("*.py") if p.stem != "__init__")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_moe_modules_live_in_its_rooms():
    """moe/ holds its rooms (MOE_ROOMS) and its package file, nothing flat beside them."""
    flat = sorted(p.name for p in (ROOT / "moe").glob("*.py") if p.stem != "__init__")
    rooms = sorted(p.name for p in (ROOT / "moe").iterdir()
                   if p.is_dir() and p.name != "__pycache__")
    assert flat == [] and rooms == sorted(MOE_ROOMS), (flat, rooms)


def test_tools_holds_only_the_user_clis():
    entries = {p.stem if p.suffix == ".py" else p.name for p in (ROOT / "tools").iterdir()
               if p.name != "__pycache__"}
    assert entries == TOOLS, f"not a user CLI: {sorted(entries - TOOLS)}; missing: " \
        f"{sorted(TOOLS - entries)} (benchmarks and profilers live in bench/)"


def test_the_cli_loads_neither_torch_nor_megatron_before_a_job():
    """`megatron-gspo config`, --help and argument errors answer in a fraction of a second."""
    code = ("import sys, megatron_gspo.cli as cli; cli.main(['config']); "
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
