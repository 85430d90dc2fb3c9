"""The settings reference (docs/settings.md), generated from the settings modules themselves.

Every setting in ``console/settings/*.py`` is an upper-case assignment with its one-line doc
in ``#:`` comments right above it; the environment variable it reads (``os.environ``,
``os.getenv`` or the ``env*`` helpers of ``console.settings.env``) and its default are read
from the assignment's source. ``python manage.py settings_reference`` writes docs/settings.md;
``--check`` fails when the file is stale. tests/console/test_settings_reference.py fails on a
setting without its doc and on a stale file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SETTINGS_DIR = Path(__file__).resolve().parent / "settings"
REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
ENV_HELPERS = {"envbool", "envint", "envfloat", "envlist"}


@dataclass(frozen=True)
class SettingDoc:
    module: str  # the settings module's name ("gateway")
    name: str
    doc: str  # "" when it has none
    env: str  # the environment variable it reads ("" when none)
    default: str  # the default's source ("" when none is given in the call)
    line: int


def _env_call(node: ast.AST, source: str) -> tuple[str, str] | None:
    """(variable, default source) when ``node`` itself is an environment read."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    helper = isinstance(func, ast.Name) and func.id in ENV_HELPERS
    getter = isinstance(func, ast.Attribute) and (
        (func.attr == "get" and isinstance(func.value, ast.Attribute) and func.value.attr == "environ")
        or (func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os")
    )
    first = node.args[0]
    if (helper or getter) and isinstance(first, ast.Constant) and isinstance(first.value, str):
        default = ast.get_source_segment(source, node.args[1]) if len(node.args) > 1 else ""
        return first.value, default or ""
    return None


def _env_read(value: ast.expr, source: str) -> tuple[str, str]:
    """(variable, default source) of the first environment read in ``value``."""
    for node in ast.walk(value):
        found = _env_call(node, source)
        if found is not None:
            return found
    return "", ""


def env_reads(path: Path) -> list[tuple[str, int]]:
    """Every environment variable the module reads, wherever it reads it, with the line."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        read = _env_call(node, source)
        if read is not None and isinstance(node, ast.Call):
            found.append((read[0], node.lineno))
    return sorted(found, key=lambda read: read[1])


def unlisted_env_reads() -> list[str]:
    """``module:line NAME`` of each environment read no setting of the reference lists: one
    inside an expression (a beat entry, a pool's options) instead of a setting of its own."""
    listed = {setting.env for setting in reference() if setting.env}
    return [
        f"{path.stem}:{line} {env}"
        for path in sorted(SETTINGS_DIR.glob("*.py"))
        if path.stem != "env"
        for env, line in env_reads(path)
        if env not in listed
    ]


def _docs_above(lines: list[str], lineno: int) -> str:
    """The ``#:`` comment lines right above line ``lineno`` (1-based), joined."""
    found: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return " ".join(found)


def settings_of(path: Path) -> list[SettingDoc]:
    source = path.read_text()
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper() and not target.id.startswith("_"):
                env, default = _env_read(value, source)
                doc = _docs_above(lines, node.lineno)
                out.append(SettingDoc(path.stem, target.id, doc, env, default, node.lineno))
    return sorted(out, key=lambda s: s.line)


def reference() -> list[SettingDoc]:
    """Every setting of every settings module, in module order then source order (a name set
    in two places, e.g. by environment, listed once: its first)."""
    seen: set[str] = set()
    out = []
    for path in sorted(SETTINGS_DIR.glob("*.py")):
        if path.stem in ("__init__", "env"):
            continue
        for setting in settings_of(path):
            if setting.name not in seen:
                seen.add(setting.name)
                out.append(setting)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    settings = reference()
    parts = [
        "# Settings reference",
        "",
        "Generated from `console/settings/*.py` by `python manage.py settings_reference` (do not edit by",
        "hand; `tests/console/test_settings_reference.py` fails when this file is stale or a setting has",
        "no doc). Each setting is read from the environment variable of its row, when it has one; the",
        'default is the expression the settings module gives. README\'s "Configuration" explains the',
        "settings most deployments touch.",
        "",
        f"{len(settings)} settings, {sum(1 for s in settings if s.env)} of them read from the environment.",
    ]
    module = ""
    for setting in settings:
        if setting.module != module:
            module = setting.module
            parts += ["", f"## `{module}`", "", "| setting | environment | default | what it is |", "|---|---|---|---|"]
        env = f"`{setting.env}`" if setting.env else ""
        default = f"`{_cell(setting.default)}`" if setting.default else ""
        parts.append(f"| `{setting.name}` | {env} | {default} | {_cell(setting.doc)} |")
    return "\n".join(parts) + "\n"
