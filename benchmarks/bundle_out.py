"""Packs the JSON and log files under a directory into one bundle.json (the device returns a
limited number of files per call) and unpacks it again here.

    python benchmarks/bundle_out.py pack $OUT
    python benchmarks/bundle_out.py unpack bundle.json DEST
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def pack(root: Path) -> None:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".log")
                   and p.name != "bundle.json")
    bundle = {}
    for p in files:
        text = p.read_text()
        bundle[str(p.relative_to(root))] = json.loads(text) if p.suffix == ".json" else text
    (root / "bundle.json").write_text(json.dumps(bundle, indent=1))
    for p in files:
        p.unlink()
    print(f"bundled {len(files)} files into {root / 'bundle.json'}")


def unpack(bundle: Path, dest: Path) -> None:
    for rel, content in json.loads(bundle.read_text()).items():
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(content, indent=1) if rel.endswith(".json") else content)
        print(out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "pack":
        pack(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "unpack":
        unpack(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
