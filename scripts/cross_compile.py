#!/usr/bin/env python3
"""Build an artifact for a board on this (x86) machine, and with --to deploy it there: ``boardtalk deploy``.

    python scripts/cross_compile.py --board pi5 --out pi5.tar.gz             # build only (kernels for the Cortex-A76)
    python scripts/cross_compile.py --board pi5 --to pi@raspberrypi.local    # build, copy, install, verify
    python scripts/cross_compile.py --board jetson-orin-nano --to nvidia@orin --dry-run

The same options and steps as ``boardtalk deploy`` (models/deploy.py; docs/deploy.md): this file only
runs that command, so the two never drift apart.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from runtime.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["deploy", *sys.argv[1:]]))
