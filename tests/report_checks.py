"""Checks of a written run report, shared by tests/test_report.py (synthetic metrics) and
tests/test_e2e.py (a short real run): every referenced plot exists, is a PNG that decodes, and
has data drawn (colored pixels: an empty axis, its ticks and labels are only gray)."""

from __future__ import annotations

import re
from pathlib import Path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_COLORED_PIXELS = 50  # a drawn line or bar covers hundreds; anti-aliased gray text covers none


def colored_pixels(png: Path) -> int:
    """Pixels whose RGB channels differ by more than 0.15 (matplotlib's data colors C0..C9 do)."""
    import matplotlib.image as mpimg

    img = mpimg.imread(png)[..., :3]
    return int(((img.max(axis=-1) - img.min(axis=-1)) > 0.15).sum())


def check_report(html_path: Path, expect: set[str] | None = None) -> list[str]:
    """Assert report.html's images exist beside it, are valid PNGs with data; return their names.
    `expect`: the exact set of plot files that must be referenced."""
    assert html_path.is_file(), html_path
    text = html_path.read_text()
    refs = re.findall(r"""(?:src|href)=['"]([^'"#]+)['"]""", text)
    assert refs, "report.html references no plot"
    for ref in refs:
        assert "://" not in ref and not ref.startswith("/"), f"external or absolute reference {ref}"
        png = html_path.parent / ref
        assert png.is_file(), f"report.html references {ref}, which does not exist"
        assert png.read_bytes()[:8] == PNG_MAGIC, f"{ref} is not a PNG"
        assert colored_pixels(png) >= MIN_COLORED_PIXELS, f"{ref}: no data drawn (empty axes)"
    if expect is not None:
        assert set(refs) == expect, (sorted(refs), sorted(expect))
    return refs
