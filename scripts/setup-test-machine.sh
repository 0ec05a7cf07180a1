#!/usr/bin/env bash
# The system packages the test suite uses outside its venv, installed with apt-get when missing (the README's test
# command runs this first; CI runs that command). Present ones are left alone, so a second run installs nothing;
# what it installs, it says. Without apt-get or root it installs nothing: it says what to install and exits 1.
#
#   chromium:   Debian's browser; the chat page's browser tests drive it through Playwright (no browser download)
#   the linter: shellcheck lints the image's entrypoint.sh (tests/test_docker.py)
#   the agents: Claude Code, Codex and OpenCode from npm at pinned versions, into the gitignored .agents/ of the
#               checkout (tests/test_agents_cli.py runs them there; ~1.2 GB, 20-40 s), each skipped when that version is
#               present
set -euo pipefail

NEEDED=(chromium:chromium shellcheck:shellcheck)  # the command the tests run : the Debian package that provides it

commands=() missing=()
for need in "${NEEDED[@]}"; do
  commands+=("${need%%:*}")
  command -v "${need%%:*}" >/dev/null 2>&1 || missing+=("${need#*:}")
done
# The checkout's .agents/ (GEMMA4_AGENTS_PREFIX: another prefix, which tests/test_test_command.py uses); builtins
# only, so that a bare PATH does (no dirname).
script_dir="${BASH_SOURCE[0]%/*}"
[ "$script_dir" != "${BASH_SOURCE[0]}" ] || script_dir=.
AGENTS_PREFIX="${GEMMA4_AGENTS_PREFIX:-$(cd "$script_dir/.." && pwd)/.agents}"
AGENTS=(claude:@anthropic-ai/claude-code@2.1.332 codex:@openai/codex@0.171.0 opencode:opencode-ai@1.18.33)

install_agents() {  # the agent CLIs whose pinned version is not under the prefix yet
  local need=() bin version
  for agent in "${AGENTS[@]}"; do
    bin="$AGENTS_PREFIX/bin/${agent%%:*}"
    version=""
    if [ -x "$bin" ]; then version="$("$bin" --version 2>/dev/null || true)"; fi  # not piped to grep -q (SIGPIPE)
    [[ "$version" == *"${agent##*@}"* ]] || need+=("${agent#*:}")
  done
  if [ "${#need[@]}" -eq 0 ]; then
    echo "setup-test-machine: present, nothing to install: the agent CLIs in $AGENTS_PREFIX"
    return 0
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "setup-test-machine: the agent tests need ${need[*]} from npm, and npm is missing." \
      "Install Node.js 20 or later with npm (Debian: apt-get install -y nodejs npm), then run the command again." >&2
    return 1
  fi
  echo "setup-test-machine: installing ${need[*]} with npm into $AGENTS_PREFIX (the agent tests run them)"
  # Their install scripts only link each package's platform binary (an npm dependency); npm 11 runs them when allowed.
  npm install --global --prefix "$AGENTS_PREFIX" --allow-scripts=@anthropic-ai/claude-code,opencode-ai --no-fund \
    --no-audit --loglevel=error "${need[@]}"
}

if [ "${#missing[@]}" -eq 0 ]; then
  echo "setup-test-machine: present, nothing to install: ${commands[*]}"
  install_agents
  exit $?
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "setup-test-machine: the tests need ${missing[*]}; this script installs them only as root with apt-get." \
    "Install them (Debian: apt-get install -y ${missing[*]}), then run the command again." >&2
  exit 1
fi
echo "setup-test-machine: installing ${missing[*]} with apt-get (the tests use them outside the venv)"
export DEBIAN_FRONTEND=noninteractive  # no prompt may hold up an unattended run
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
apt-get clean  # the package lists and .debs: disk is scarce on CI machines
for need in "${NEEDED[@]}"; do  # a package that installed but gives no such command would fail the tests later
  command -v "${need%%:*}" >/dev/null 2>&1 || { echo "setup-test-machine: ${need#*:} gave no ${need%%:*}" >&2; exit 1; }
done
echo "setup-test-machine: installed ${missing[*]}"
install_agents
