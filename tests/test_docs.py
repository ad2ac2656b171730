"""The docs name only what exists: every path and link in README.md and docs/**/*.md resolves in the repository
(headings included, for `#anchors`), every `dpltm.x.y` name is defined, every ```python block compiles, and
every `dpltm COMMAND --flag` shown is a real command with that option. The README and the results summary
stay short. No network, no imports of torch: a few seconds."""

from __future__ import annotations

import ast
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINE_LIMITS = {"README.md": 200, "docs/results.md": 150}

# Repository paths the docs name by these prefixes must exist (checkpoints/, logs/ and runs/ are what runs create).
PATH_RE = re.compile(r"(?<![\w./:~-])((?:dpltm|benchmarks|configs|docs|examples|tests|docker|\.ci)/"
                     r"[^\s`'\"()\[\]<>,;|…*#]*)")
# Named but legitimately not in the repository, each with its reason.
ALLOWED_MISSING_PATHS = {
    "../shared/data": "the default data root, beside the repository on this project's machines",
    "../shared/data/SOURCES.md": "where this machine's data came from, beside the repository",
    "../shared/UTILITY.md": "a quick utility check kept beside the repository, quoted for its figures",
}
# `dpltm.<module>[.<name>]` spelled in the docs that no file under dpltm/ defines.
ALLOWED_MODULE_NAMES = {
    "dpltm.configs": "configs/ installs as the package dpltm.configs (pyproject's package-dir)",
}
# Placeholders shown in the subcommand's place (`dpltm COMMAND -h`).
PLACEHOLDER_COMMANDS = {"COMMAND"}

FENCE_RE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE_RE = re.compile(r"`([^`]+)`")
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOTTED_RE = re.compile(r"(?<![\w./-])dpltm(?:\.[A-Za-z_]\w*)+")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def fences(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE_RE.findall(text_of(path)) if lang == language]


def prose(path: Path) -> str:
    """The file without its fenced blocks."""
    return FENCE_RE.sub("", text_of(path))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def named_paths(path: Path) -> set[str]:
    """Prefixed repository paths anywhere in the file, and backticked paths that start with ../ ."""
    text = text_of(path)
    found = {m.rstrip(".:") for m in PATH_RE.findall(text)}
    found |= {span for span in INLINE_RE.findall(prose(path)) if span.startswith("../") and " " not in span}
    return found


def test_every_named_path_exists() -> None:
    missing = []
    for doc in DOCS:
        for name in sorted(named_paths(doc)):
            if name in ALLOWED_MISSING_PATHS:
                continue
            if not (ROOT / name).exists():
                missing.append(f"{rel(doc)}: {name}")
    assert not missing, "\n".join(missing)


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK_RE.findall(INLINE_RE.sub("", prose(doc))):
            if "://" in target or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                broken.append(f"{rel(doc)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel(doc)}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


@cache
def top_level_names(module_file: Path) -> frozenset[str]:
    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(node.value, ast.Dict) and any(getattr(t, "id", "") == "_API" for t in targets):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}  # lazy exports
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def defined(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.exists():
            rest = parts[i:]
            return not rest or rest[0] in top_level_names(module) or (base / f"{rest[0]}.py").exists()
    return False


def test_every_dpltm_name_is_defined() -> None:
    undefined = []
    for doc in DOCS:
        for name in sorted(set(DOTTED_RE.findall(text_of(doc)))):
            if name not in ALLOWED_MODULE_NAMES and not defined(name):
                undefined.append(f"{rel(doc)}: {name}")
    assert not undefined, "\n".join(undefined)


def test_python_blocks_compile() -> None:
    blocks = 0
    for doc in DOCS:
        for i, block in enumerate(fences(doc, "python")):
            compile(block, f"{rel(doc)} block {i}", "exec")
            blocks += 1
    assert fences(ROOT / "README.md", "python") and len(fences(ROOT / "docs" / "api.md", "python")) >= 4
    assert blocks


@cache
def cli_options() -> dict[str, frozenset[str]]:
    """Each subcommand's options (`--x`, `--no-x`, `-h`), from the typer app itself; "" is the top level."""
    import typer

    from dpltm.cli import app

    group = typer.main.get_command(app)
    def opts(command) -> frozenset[str]:  # type: ignore[no-untyped-def]
        return frozenset(o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")) | {
            "--help", "-h"}
    return {"": opts(group), **{name: opts(command) for name, command in group.commands.items()}}  # type: ignore[attr-defined]


def command_lines(doc: Path) -> list[list[str]]:
    """The argument lists of every `dpltm …` invocation in the file: in ```bash blocks, every command of every
    line (comments dropped, `\\` continuations joined, split at && || ; |); in inline code, spans that start
    with `dpltm ` (optional parts in [brackets] included)."""
    found = []
    for block in fences(doc, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line)
            for segment in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(segment)
                if words and Path(words[0]).name == "dpltm":
                    found.append(words[1:])
    for span in INLINE_RE.findall(prose(doc)):
        if span.startswith("dpltm "):
            found.append(span.replace("[", " ").replace("]", " ").split()[1:])
    return found


def test_every_dpltm_command_and_flag_shown_exists() -> None:
    options = cli_options()
    wrong = []
    for doc in DOCS:
        for args in command_lines(doc):
            command = args[0] if args and not args[0].startswith("-") else ""
            if command in PLACEHOLDER_COMMANDS:
                command_opts = frozenset({"--help", "-h"})
            elif command not in options:
                wrong.append(f"{rel(doc)}: dpltm {' '.join(args)} (no command {command!r})")
                continue
            else:
                command_opts = options[command]
            for word in args[1 if command else 0:]:
                flag = word.split("=", 1)[0]
                if flag.startswith("-") and flag != "-" and flag not in command_opts:
                    wrong.append(f"{rel(doc)}: dpltm {' '.join(args)} ({flag} is not an option of {command!r})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("name", "limit"), sorted(LINE_LIMITS.items()))
def test_the_front_pages_stay_short(name: str, limit: int) -> None:
    assert len(text_of(ROOT / name).splitlines()) <= limit
