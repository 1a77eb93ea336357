"""Write the dashboards as JSON: ``python dashboards/src/generate.py`` (``--check`` only compares).

The committed ``dashboards/*.json`` must equal this output; ``tests/test_dashboards.py`` checks it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_alloc_dashboards import OUT, rendered  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file differs from the generated one")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(f"{'differs' if args.check else 'wrote'}: {path.relative_to(OUT.parent)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
