"""Download the genuine intersphinx inventories to ``docs/_intersphinx/``.

Run on a machine with internet access (``python docs/_ext/fetch_inventories.py``);
``conf.py`` then links to Python, NumPy and the array API standard from an offline
build. Without these files the build still succeeds, with plain-text references.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conf import INTERSPHINX_TARGETS  # noqa: E402


def main():
    out = Path(__file__).resolve().parents[1] / "_intersphinx"
    out.mkdir(exist_ok=True)
    for name, url in INTERSPHINX_TARGETS.items():
        with urllib.request.urlopen(f"{url}/objects.inv", timeout=30) as r:
            data = r.read()
        if not data.startswith(b"# Sphinx inventory version"):
            raise SystemExit(f"{url}/objects.inv is not a Sphinx inventory")
        (out / f"{name}.inv").write_bytes(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
