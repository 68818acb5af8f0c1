"""The shape of the code that CI holds: the layers the docs describe are the layers
import-linter enforces, classes and modules stay small, the README stays a user's page, and
every package's `__init__.py` says what its modules are."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "kube_userspace_proxy"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYER_CONTRACT = "Layers of the package"
LAYERS_MARKER = "<!-- layers:"

MAX_CLASS_LINES = 400
MAX_MODULE_LINES = 650
MAX_README_LINES = 400

Layer = frozenset[str]


def _layer(text: str) -> Layer:
    """`ops | proxier | workers` -> {"ops", "proxier", "workers"}."""
    return frozenset(part.strip() for part in text.split("|"))


def _show(layers: list[Layer]) -> str:
    return "\n".join(" | ".join(sorted(layer)) for layer in layers)


def pyproject_layers() -> list[Layer]:
    """The root layer contract of `[tool.importlinter]`, top to bottom."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == LAYER_CONTRACT]
    assert contract["containers"] == ["kube_userspace_proxy"]
    return [_layer(line) for line in contract["layers"]]


def documented_layers() -> list[Layer]:
    """The fenced block after the layers marker in docs/architecture.md (`#` starts a comment)."""
    text = ARCHITECTURE.read_text()
    after = text.split(LAYERS_MARKER, 1)
    assert len(after) == 2, f"{ARCHITECTURE} has no {LAYERS_MARKER!r} marker"
    block = re.search(r"^```[^\n]*\n(.*?)^```", after[1], re.MULTILINE | re.DOTALL)
    assert block, f"no fenced block after the layers marker in {ARCHITECTURE}"
    lines = (line.split("#", 1)[0].strip() for line in block.group(1).splitlines())
    return [_layer(line) for line in lines if line]


def test_the_architecture_page_lists_the_layers_that_import_linter_enforces() -> None:
    documented, enforced = documented_layers(), pyproject_layers()
    assert documented == enforced, (
        f"docs/architecture.md:\n{_show(documented)}\n\npyproject.toml:\n{_show(enforced)}"
    )


def test_the_layer_list_names_every_top_level_module_and_package() -> None:
    named = set().union(*pyproject_layers())
    present = {
        path.stem if path.is_file() else path.name
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.stem not in {"__init__", "__main__"})
        or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert present - named == set(), f"not in any layer: {sorted(present - named)}"
    assert named - present == set(), f"layers name what does not exist: {sorted(named - present)}"


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_650_lines() -> None:
    over = []
    for path in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {lines} lines")
    print("\n".join(over))
    assert over == [], f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(over)


def test_no_class_is_over_400_lines() -> None:
    over = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - start + 1
                if lines > MAX_CLASS_LINES:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    print("\n".join(over))
    assert over == [], f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(over)


def test_the_readme_is_at_most_400_lines() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move the rest to docs/"


def test_the_readme_shows_two_pictures_before_its_first_section() -> None:
    # A reader looks at pictures before reading: the /debug/ui screenshot and a benchmark
    # chart, as PNGs in the repository, above the Quick start.
    text = (ROOT / "README.md").read_text()
    top = text[: text.index("\n## ")]
    pictures = re.findall(r'<img src="([^"]+\.png)"', top)
    assert len(pictures) >= 2, pictures
    assert any("debug-ui" in p for p in pictures) and any("peers" in p for p in pictures)
    for picture in pictures:
        assert (ROOT / picture).is_file(), picture
        assert (ROOT / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture


def test_every_package_has_an_init_docstring() -> None:
    packages = sorted({path.parent for path in _sources()})
    assert PACKAGE in packages
    missing = []
    for package in packages:
        init = package / "__init__.py"
        if not init.exists():
            missing.append(f"{package.relative_to(ROOT)}: no __init__.py")
        elif not (ast.get_docstring(ast.parse(init.read_text())) or "").strip():
            missing.append(f"{init.relative_to(ROOT)}: no docstring")
    assert missing == [], "\n".join(missing)


def test_the_architecture_page_names_every_module() -> None:
    """A newcomer finds every module on the architecture page (a new one is added there)."""
    page = ARCHITECTURE.read_text()
    missing = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
        and path.relative_to(PACKAGE).parts[0] not in ("dataplane", "portals")
        and f"`{path.relative_to(PACKAGE)}`" not in page
    ]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_test_files_have_unique_names() -> None:
    """pytest imports test files of packageless folders by basename: two alike stop the run."""
    names = [path.name for path in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
