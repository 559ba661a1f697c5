"""The wheel a non-editable install makes holds every module and every file the package reads at run time.

The editable install the tests run on maps the folders at run time, so a package missing from pyproject.toml shows only
in a wheel: this builds one from a copy of the sources, with setuptools as `pip install .` does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where each part of the package lives in the repository (see the README's layout).
FOLDERS = {
    "prefixgate": "prefixgate",
    "prefixgate/proxy": "proxy",
    "prefixgate/backends": "backends",
    "prefixgate/store": "store",
    "prefixgate/policies": "policies",
}
RUNTIME_FILES = {".py", ".c", ".h", ".cpp", ".html"}  # modules, the kernels' sources, the dashboard page


def test_the_wheel_holds_every_module_kernel_source_and_page(tmp_path: Path) -> None:
    sources = tmp_path / "src"
    sources.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, sources / name)
    expected = set()
    for package, folder in FOLDERS.items():
        shutil.copytree(ROOT / folder, sources / folder, ignore=shutil.ignore_patterns("__pycache__"))
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in RUNTIME_FILES and "__pycache__" not in path.parts:
                expected.add(f"{package}/{path.relative_to(ROOT / folder).as_posix()}")
    assert "prefixgate/backends/tool_calls/hermes.py" in expected  # a subpackage is among them

    built = subprocess.run(
        [sys.executable, "-c", "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))", "dist"],
        cwd=sources,
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = sources / "dist" / built.stdout.split()[-1]
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(expected - in_wheel) == []
