"""Headless Chromium (Debian's package) for tests that look at a page as a person would: the DOM after the page's
scripts ran, and a screenshot. Installed with apt-get on first use when missing and running as root (CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps trying hosts this closed network refuses.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def ensure_chromium() -> str:
    if not Path(CHROMIUM).exists():
        if os.geteuid() != 0:
            raise RuntimeError(f"{CHROMIUM} is missing: apt-get install chromium (as root)")
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return CHROMIUM


def render(page: Path, workdir: Path, *, width: int = 1000, height: int = 3000) -> tuple[str, Path]:
    """(the DOM after load, as HTML; a PNG screenshot) of the local file `page`."""
    chromium = ensure_chromium()
    profile = workdir / "chromium-profile"
    shutil.rmtree(profile, ignore_errors=True)
    common = [chromium, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000",
              f"--window-size={width},{height}"]
    dom = subprocess.run([*common, "--dump-dom", page.resolve().as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    shot = workdir / "screenshot.png"
    subprocess.run([*common, f"--screenshot={shot}", page.resolve().as_uri()], capture_output=True, timeout=120,
                   check=True)
    return dom, shot
