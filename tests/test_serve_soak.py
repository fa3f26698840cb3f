"""A shortened scripts/soak.py in CI: API turns (every tenth cut mid-stream by the client) in one process;
after warm-up RSS grows < 2 MiB and no fd or thread is left behind. The full run (500 API + 200 voice turns)
is ``python scripts/soak.py soak``; its figures are in docs/service.md."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_short_soak_holds_memory_fds_and_threads(real_artifacts):
    pytest.importorskip("aiohttp", reason="boardtalk serve needs aiohttp: pip install 'boardtalk[serve]'")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "soak", "--api-turns", "120",
                        "--voice-turns", "0", "--artifact", str(real_artifacts["native"])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]
