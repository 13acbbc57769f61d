"""What installing memra does to the machine: the test extra leaves a CUDA build of torch and the Triton it
pins alone, and the README's test command is the one CI runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_test_extra_pins_nothing_that_torch_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    assert not [r for r in extras["test"] + project["dependencies"] if re.match(r"(triton|torch)\b", r) and "<" in r]
    assert any(r.startswith("triton>=3.2;") for r in extras["test"])  # the CPU suite's interpreter


def test_the_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in readme
