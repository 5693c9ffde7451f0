"""The results files every offline benchmark writes: ``<out_dir>/<name>.json`` and ``.md``."""

from __future__ import annotations

import json
import os


def write_report(out_dir: str, name: str, data: dict, lines: list[str]) -> str:
    """Write ``data`` as JSON and ``lines`` as the markdown page; returns the path without extension."""
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, name)
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}.json and .md")
    return out
