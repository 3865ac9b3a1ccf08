"""`miles report` on a real run, rendered by headless Chromium: the page must show its figures."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from .conftest import run_miles

WINDOW = (1400, 4000)
BAND_PX = 200  # the screenshot is checked in horizontal bands of this height


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium renders the report in this test: apt-get install chromium"
    return found


def screenshot(page: Path, png: Path, profile: Path) -> np.ndarray:
    """The page as Chromium draws it, RGB floats in [0, 1], WINDOW[1] rows by WINDOW[0]."""
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--screenshot={png}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.is_file(), f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr}"
    import matplotlib.image

    pixels = np.asarray(matplotlib.image.imread(png))[..., :3]
    if pixels.dtype == np.uint8:
        pixels = pixels / 255.0
    return pixels


def looks_rendered(pixels: np.ndarray) -> tuple[bool, str]:
    """Not blank, and coloured (non-grey) pixels in many bands of the page: the plots drew.

    The page itself is black, grey and white apart from a small status badge, so saturated colour
    comes from the figures' lines, markers and timeline bars."""
    non_white = float((pixels.min(axis=-1) < 0.9).mean())
    saturation = pixels.max(axis=-1) - pixels.min(axis=-1)
    coloured = saturation > 0.3
    bands = [int(coloured[y : y + BAND_PX].sum()) for y in range(0, len(coloured), BAND_PX)]
    coloured_bands = sum(n >= 300 for n in bands)
    why = f"non-white {non_white:.3f}, coloured pixels per band {bands}"
    return non_white > 0.025 and coloured_bands >= 5, why


def test_report_of_a_real_run_renders(tmp_path: Path, traced_run: tuple[Path, Any]) -> None:
    """The run of tests/conftest.py's `traced_run`: 2 steps, 2 train ranks, 2 engines, a
    checkpoint every step."""
    chromium()  # fail first, with the install hint
    run_dir = traced_run[0]
    proc = run_miles("report", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = run_dir / "report"
    written = [Path(line) for line in proc.stdout.split()]
    assert written[0] == out / "index.html"
    assert {p.name for p in written[1:]} >= {"reward.png", "loss.png", "timeline.png", "idle.png"}
    html = written[0].read_text()
    assert "badge finished" in html and "2 of 2" in html
    assert html.count("data:image/png;base64,") == len(written) - 1
    steps = re.findall(r"<tr><td class='num'>(\d+)</td>", html.split("Slowest steps", 1)[1])
    assert sorted(int(s) for s in steps) == [0, 1]  # both steps, in the top 5

    ok, why = looks_rendered(screenshot(written[0], tmp_path / "page.png", tmp_path / "chrome"))
    print(why)
    assert ok, why

    # The check can fail: the same page without its image data renders no plots.
    broken = out / "broken.html"
    broken.write_text(re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:,", html))
    ok, why = looks_rendered(screenshot(broken, tmp_path / "broken.png", tmp_path / "chrome"))
    print(why)
    assert not ok, f"a page without figures passed the check: {why}"
