"""Issue 37: the README's test command is the whole set-up, and CI runs exactly it.

- `.ci/run` runs the command the README shows (it reads it from the README: `--print-test-command` prints what it
  read), and the command starts with `scripts/setup-test-machine.sh`; docs/development.md shows the same command.
- The set-up script, on a PATH of stand-ins (no package is installed or removed here): installs nothing when
  chromium and shellcheck are present; installs what is missing with apt-get as root, and says so; a second run
  installs nothing; without apt-get, or not root, it installs nothing, names the packages and exits 1. The agent CLIs
  (npm, into a prefix): installed at their pinned versions when missing, skipped when present; without npm it says
  what to install and exits 1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup-test-machine.sh"
BASH = shutil.which("bash") or "/bin/bash"
CHMOD = shutil.which("chmod") or "/bin/chmod"  # by path: the stand-in PATH holds stand-ins only


def readme_test_command() -> str:
    """The one line of the README's bash block after "Run the tests" (read here independently of .ci/run's awk)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^Run the tests.*?^```bash\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert block is not None, "README.md: no bash block after 'Run the tests'"
    lines = block.group(1).strip().splitlines()
    assert len(lines) == 1, "the README's test command is one line, to be copied whole"
    return lines[0]


def test_ci_runs_the_readmes_test_command() -> None:
    command = readme_test_command()
    printed = subprocess.run([BASH, str(ROOT / ".ci" / "run"), "--print-test-command"], capture_output=True, text=True,
                             timeout=30, cwd=ROOT)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == command  # what .ci/run reads from the README is the command shown
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    runs = [line for line in ci.splitlines() if re.match(r'^[^#]*\bbash -c "\$test_command"', line)]
    assert len(runs) == 1, "`.ci/run` must run the README's command it read (`bash -c \"$test_command\"`), once"
    # the set-up comes first: whatever the suite needs outside the venv is there before anything else runs
    assert command.startswith("bash scripts/setup-test-machine.sh && python3 -m venv .venv && ")
    assert command.endswith(" && python -m pytest -q")


def test_development_md_shows_the_same_command_a_step_a_line() -> None:
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    block = re.search(r"^## Tests\n\n```bash\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
    assert block is not None
    steps = [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert " && ".join(steps) == readme_test_command()


@pytest.mark.parametrize("script", [SETUP, ROOT / ".ci" / "run"], ids=["setup-test-machine", "ci-run"])
def test_the_scripts_pass_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:  # as tests/test_docker.py's entrypoint check: the README's command installs it
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("shellcheck is not installed; the README's test command installs it")
        pytest.skip("shellcheck is not installed (bash scripts/setup-test-machine.sh installs it)")
    result = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(script)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ the set-up script, on stand-in commands


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n", encoding="utf-8")
    path.chmod(0o755)


AGENTS = {"claude": "2.1.332", "codex": "0.171.0", "opencode": "1.18.33"}  # the script's pins
PACKAGES = {"@anthropic-ai/claude-code": "claude", "@openai/codex": "codex", "opencode-ai": "opencode"}


def agents_installed(tmp_path: Path, versions: dict[str, str]) -> None:
    """Stand-ins of the agent CLIs in the script's prefix, each printing its version."""
    bin_dir = tmp_path / "agents" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, version in versions.items():
        stand_in(bin_dir, name, f"echo '{version} ({name})'")


def machine(tmp_path: Path, *, present: tuple[str, ...] = (), apt: bool = True, uid: int = 0, agents: bool = True,
            npm: bool = True) -> Path:
    """A PATH holding only stand-ins: `present` commands, `id` answering `uid`, and (`apt`) an apt-get that logs its
    calls and "installs" a package by putting a command of its name on that PATH; (`agents`) the agent CLIs at their
    pinned versions in the prefix, and (`npm`) an npm that logs its calls and "installs" them there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if agents:
        agents_installed(tmp_path, AGENTS)
    if npm:
        cases = "\n".join(f"      {package}@*) name={name} ;;" for package, name in PACKAGES.items())
        stand_in(bin_dir, "npm", f"""echo "$*" >> {tmp_path / "npm.log"}
for package in "$@"; do
  case "$package" in
{cases}
      *) continue ;;
  esac
  printf '#!{BASH}\\necho %s\\n' "${{package##*@}}" > {tmp_path}/agents/bin/"$name"
  {CHMOD} 755 {tmp_path}/agents/bin/"$name"
done""")
    for name in present:
        stand_in(bin_dir, name, "exit 0")
    stand_in(bin_dir, "id", f"echo {uid}")
    if apt:
        stand_in(bin_dir, "apt-get", f"""echo "$*" >> {tmp_path / "apt.log"}
if [ "$1" = install ]; then
  for package in "$@"; do
    case "$package" in
      -* | install) ;;
      *) printf '#!{BASH}\\nexit 0\\n' > {bin_dir}/"$package"; {CHMOD} 755 {bin_dir}/"$package" ;;
    esac
  done
fi""")
    return bin_dir


def setup(bin_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASH, str(SETUP)], capture_output=True, text=True, timeout=30, cwd=ROOT,
                          env={"PATH": str(bin_dir), "HOME": str(bin_dir.parent),
                               "GEMMA4_AGENTS_PREFIX": str(bin_dir.parent / "agents")})


def npm_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "npm.log"
    return log.read_text(encoding="utf-8").splitlines() if log.exists() else []


def apt_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "apt.log"
    return log.read_text(encoding="utf-8").splitlines() if log.exists() else []


def test_with_everything_present_it_installs_nothing(tmp_path: Path) -> None:
    done = setup(machine(tmp_path, present=("chromium", "shellcheck")))
    assert done.returncode == 0, done.stderr
    assert "nothing to install" in done.stdout and "nothing to install: the agent CLIs" in done.stdout
    assert apt_calls(tmp_path) == [] and npm_calls(tmp_path) == []


def test_it_installs_what_is_missing_says_so_and_a_second_run_installs_nothing(tmp_path: Path) -> None:
    bin_dir = machine(tmp_path, present=("shellcheck",))
    done = setup(bin_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installing chromium with apt-get" in done.stdout and "installed chromium" in done.stdout
    assert apt_calls(tmp_path) == ["update -qq", "install -y -qq chromium", "clean"]
    again = setup(bin_dir)
    assert again.returncode == 0 and "nothing to install" in again.stdout
    assert len(apt_calls(tmp_path)) == 3  # idempotent: no apt-get call the second time


def test_a_package_that_gives_no_command_fails(tmp_path: Path) -> None:
    bin_dir = machine(tmp_path, present=("chromium",))
    stand_in(bin_dir, "apt-get", "exit 0")  # "installs" without providing the command
    done = setup(bin_dir)
    assert done.returncode == 1 and "shellcheck gave no shellcheck" in done.stderr


@pytest.mark.parametrize(("apt", "uid"), [(False, 0), (True, 1000)], ids=["no-apt-get", "not-root"])
def test_where_it_cannot_install_it_names_the_packages_and_exits_1(tmp_path: Path, apt: bool, uid: int) -> None:
    done = setup(machine(tmp_path, apt=apt, uid=uid))
    assert done.returncode == 1
    assert "apt-get install -y chromium shellcheck" in done.stderr, done.stderr
    assert apt_calls(tmp_path) == []


def test_the_agent_clis_missing_or_stale_are_installed_at_their_pins_and_a_second_run_installs_nothing(
        tmp_path: Path) -> None:
    bin_dir = machine(tmp_path, present=("chromium", "shellcheck"), agents=False)
    agents_installed(tmp_path, {"codex": AGENTS["codex"], "opencode": "1.0.0"})  # one current, one stale
    done = setup(bin_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installing @anthropic-ai/claude-code@2.1.332 opencode-ai@1.18.33 with npm" in done.stdout, done.stdout
    (call,) = npm_calls(tmp_path)
    assert call.startswith(f"install --global --prefix {tmp_path / 'agents'} ")
    assert call.endswith(" @anthropic-ai/claude-code@2.1.332 opencode-ai@1.18.33")
    again = setup(bin_dir)
    assert again.returncode == 0 and "nothing to install: the agent CLIs" in again.stdout, again.stdout
    assert len(npm_calls(tmp_path)) == 1


def test_without_npm_it_says_what_to_install_and_exits_1(tmp_path: Path) -> None:
    done = setup(machine(tmp_path, present=("chromium", "shellcheck"), agents=False, npm=False))
    assert done.returncode == 1
    assert "npm is missing" in done.stderr and "apt-get install -y nodejs npm" in done.stderr, done.stderr
