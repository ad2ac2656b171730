"""Every privacy fact the code cites (`docs/privacy.md §N`) is in the repository, under that number."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_cited_section_of_docs_privacy_exists() -> None:
    headings = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "privacy.md").read_text(), re.M))
    cited: dict[str, set[str]] = {}
    for path in [*(ROOT / "dpltm").rglob("*.py"), ROOT / "README.md", *(ROOT / "benchmarks").rglob("*.py")]:
        for section in re.findall(r"privacy\.md §(\d+)", path.read_text()):
            cited.setdefault(section, set()).add(path.relative_to(ROOT).as_posix())
    assert cited, "no citation found: the pattern is stale"
    missing = {s: sorted(files) for s, files in cited.items() if s not in headings}
    assert not missing, missing
    outside = [p for p in (ROOT / "dpltm").rglob("*.py") if "shared/PRIVACY" in p.read_text()]
    assert not outside, outside
