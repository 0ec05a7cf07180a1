"""The agent CLIs as the tests run them: where scripts/setup-test-machine.sh installs them, and each one's headless,
offline setup (a scratch HOME, its provider pointed at the live server, telemetry and update checks off).

The variables are the CLIs' own documented switches:
- Claude Code: ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY; CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 (telemetry,
  error reporting, auto-update, feedback, all at once), with DISABLE_TELEMETRY, DISABLE_ERROR_REPORTING and
  DISABLE_AUTOUPDATER spelled out as well.
- Codex: CODEX_HOME/config.toml with a `model_providers` entry (`wire_api = "responses"`), analytics and feedback off,
  no update check; it runs with `--skip-git-repo-check` in a scratch project.
- OpenCode: XDG_* dirs into the scratch HOME, an `opencode.json` provider on `@ai-sdk/openai-compatible` (bundled in
  the binary: nothing to download), OPENCODE_DISABLE_MODELS_FETCH=1 (no models.dev catalogue),
  OPENCODE_DISABLE_AUTOUPDATE=1, `share: disabled`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / ".agents"  # scripts/setup-test-machine.sh's npm prefix (gitignored)
PINNED = {"claude": "2.1.332", "codex": "0.171.0", "opencode": "1.18.33"}  # the script's versions, checked here
INSTALL = "bash scripts/setup-test-machine.sh"
TIMEOUT_S = 900


def cli(name: str) -> Path:
    """The installed CLI, or a failure that says how to install it (never a skip)."""
    path = PREFIX / "bin" / name
    assert path.is_file(), f"{name} is not installed under {PREFIX}: run `{INSTALL}` (it installs the agent CLIs " \
                           "from npm at pinned versions)"
    return path


@dataclass
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def why(self) -> str:
        return f"{' '.join(self.argv[:3])} exited {self.returncode} after {self.seconds:.0f} s\n" \
               f"stdout: {self.stdout[-3000:]}\nstderr: {self.stderr[-3000:]}"


def base_env(home: Path) -> dict[str, str]:
    # Only what a CLI needs from ours: PATH (node), the locale; nothing of the user's (keys, proxies, configs).
    env = {key: os.environ[key] for key in ("PATH", "LANG", "LC_ALL", "TERM") if key in os.environ}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), NO_COLOR="1",
               NO_PROXY="127.0.0.1,localhost", CI="1")
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> Run:
    start = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    return Run(argv, done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def claude_env(home: Path, base_url: str, api_key: str) -> dict[str, str]:
    """No ANTHROPIC_MODEL: Claude Code asks for its own default model name, which the server's `claude-*` alias
    takes."""
    env = base_env(home)
    env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY=api_key, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
               DISABLE_BUG_COMMAND="1", CLAUDE_CODE_DISABLE_TERMINAL_TITLE="1")
    return env


def codex_env(home: Path, base_url: str, api_key: str, model: str) -> dict[str, str]:
    """CODEX_HOME/config.toml: the server as a Responses provider, its key read from GEMMA4_API_KEY."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "gemma4"\n'
        "check_for_update_on_startup = false\n"
        "[analytics]\nenabled = false\n"
        "[feedback]\nenabled = false\n"
        "[model_providers.gemma4]\n"
        'name = "gemma4-optb"\n'
        f'base_url = "{base_url}/v1"\n'
        'env_key = "GEMMA4_API_KEY"\n'
        'wire_api = "responses"\n', encoding="utf-8")
    env = base_env(home)
    env.update(CODEX_HOME=str(codex_home), GEMMA4_API_KEY=api_key)
    return env


def opencode_env(home: Path, base_url: str, api_key: str, model: str) -> dict[str, str]:
    """~/.config/opencode/opencode.json: the server as an OpenAI-compatible provider, its model the default."""
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    (config / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"gemma4": {"npm": "@ai-sdk/openai-compatible", "name": "gemma4-optb",
                                "options": {"baseURL": f"{base_url}/v1", "apiKey": api_key},
                                "models": {model: {"name": model}}}},
        "model": f"gemma4/{model}", "small_model": f"gemma4/{model}",
        "autoupdate": False, "share": "disabled",
    }, indent=1), encoding="utf-8")
    env = base_env(home)
    env.update(OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1",
               OPENCODE_DISABLE_DEFAULT_PLUGINS="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1")
    return env
