"""The house's rules, read from the source: the root holds the core and the commands, a folder or
the core never imports a command, a command never imports another, and no import cycle. Every
import counts, those inside functions too (some are there to fail fast before JAX loads)."""
import ast
import importlib.metadata
import sys
from pathlib import Path

from conftest import ROOT

CORE = {"launch", "model", "params", "optimizers", "train", "data"}  # and configs/, tpu_scripts/
COMMANDS = {"launch", "sample", "eval", "export", "bench", "mup", "variants"}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for the repo's own Python (tests aside)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "data", "runs", "exports") or rel.parts[0].startswith("."):
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def imports(path: Path, own: set[str]) -> set[str]:
    """The repo's modules that path imports (a package's module for `from pkg import mod`)."""
    found = set()
    package = ".".join(path.relative_to(ROOT).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .configuration_mugpt import ...
                base = ".".join(filter(None, [package, base]))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in own}
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_the_root_holds_the_core_and_the_commands_only():
    root = {p.stem for p in ROOT.glob("*.py")}
    assert root <= CORE | COMMANDS, root - CORE - COMMANDS
    assert len(root) <= 12


def test_no_name_at_the_root_hides_an_installed_package():
    """The repo's root is first on sys.path when a command runs, so a folder or module there named
    like an installed package hides it from every library: transformers 5.25 requires Hugging
    Face's `kernels` and imports it, found this repo's kernels/ folder (now fused/), and export.py
    and eval.py failed. Checked against the installed distributions' import names and the
    standard library's, the tests' own modules included (pytest puts tests/ on the path)."""
    names = {name.split(".")[0] for name in modules()}
    names |= {p.stem for p in (ROOT / "tests").glob("*.py")}
    installed = importlib.metadata.packages_distributions()
    hidden = {n: installed.get(n, ["the standard library"]) for n in sorted(names)
              if n in installed or n in sys.stdlib_module_names}
    assert not hidden, f"these names at the root hide installed packages: {hidden}"


def test_no_folder_and_no_core_module_imports_a_command():
    for name, deps in graph().items():
        bad = deps & COMMANDS
        assert not bad or name in COMMANDS and not bad - {name}, f"{name} imports {bad}"


def test_no_import_cycle():
    g = graph()
    state = {}  # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [node, dep]))
            if dep not in state:
                visit(dep, path + [node])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [])


if __name__ == "__main__":  # who imports whom, for a reader (or a closing note)
    sys.path.insert(0, str(ROOT))
    for name, deps in sorted(graph().items()):
        print(f"{name}: {', '.join(sorted(deps)) or '-'}")


def test_a_profile_groups_its_ops_by_part_of_the_layer():
    """jax.named_scope on each module's forward: the compiled step's ops carry the part they
    belong to in their names, which bench.py --trace and a profiler group by."""
    import jax
    import jax.numpy as jnp

    import params
    from conftest import tiny

    cfg = tiny(connections="mudd")
    gpt = params.init_gpt(cfg, jax.random.key(0))
    hlo = jax.jit(gpt.__call__).lower(jnp.arange(16) % 60).compile().as_text()
    for part in ("embed", "block", "attn", "mlp", "mudd", "readout"):
        assert f"/{part}/" in hlo, part


def test_every_mutation_of_the_mutation_tools_still_finds_its_text(monkeypatch):
    """tools/mutate.py and tools/mutate_mup.py break a rule by replacing a text that must sit in its
    file exactly once; a move of the code (as model.py's into layers/) would otherwise leave a row
    that reports "stale" only when someone runs it."""
    monkeypatch.syspath_prepend(ROOT / "tools")  # they import each other as scripts do
    import mutate
    import mutate_mup

    rows = [(path, good) for path, edits, _ in mutate.MUTATIONS.values() for good, _ in edits]
    rows += [(path, good) for path, good, *_ in mutate_mup.MUTATIONS.values()]
    stale = [(path, good) for path, good in rows if (ROOT / path).read_text().count(good) != 1]
    assert len(rows) > 30 and not stale, stale
