"""The test side of tests/support/lm_eval_worker.py: lm-evaluation-harness in a process of its own, with no network
(the hub, datasets and transformers offline; its caches under the test's own directory), asked one run at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from tests.support.api_fixtures import ROOT

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


class Harness:
    def __init__(self, workdir: Path, include_path: Path) -> None:
        self.include_path = include_path
        self.log = workdir / "lm_eval.log"
        home = workdir / "hf-home"
        env = {**os.environ, **OFFLINE, "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"),
               "PYTHONPATH": str(ROOT)}
        self._log: IO[str] = self.log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.lm_eval_worker"], cwd=workdir, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)

    def run(self, tasks: list[str], **request: Any) -> dict[str, Any]:
        """One `simple_evaluate` (or `hf=` one of lm-eval's HFLM): its metrics, samples and wall time `wall_s`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"tasks": tasks, "include_path": str(self.include_path), **request}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # lm-eval's run itself bounds the wait (its request timeout, retries)
        assert line, f"lm-eval's worker exited ({self.proc.poll()}): {self.tail()}"
        reply = json.loads(line)
        assert "ok" in reply, f"lm-eval failed: {reply['traceback']}\n{self.tail()}"
        return dict(reply["ok"])

    def tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()
