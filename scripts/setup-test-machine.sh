#!/usr/bin/env bash
# The system packages the test suite uses outside its venv, installed with apt-get when missing (the README's test
# command runs this first; CI runs that command). Present ones are left alone, so a second run installs nothing;
# what it installs, it says. Without apt-get or root it installs nothing: it says what to install and exits 1.
#
#   chromium:   Debian's browser; the chat page's browser tests drive it through Playwright (no browser download)
#   the linter: shellcheck lints the image's entrypoint.sh (tests/test_docker.py)
#
# What the tests need later (the agent CLIs from npm) joins here: one more entry, and its installer if not apt.
set -euo pipefail

NEEDED=(chromium:chromium shellcheck:shellcheck)  # the command the tests run : the Debian package that provides it

commands=() missing=()
for need in "${NEEDED[@]}"; do
  commands+=("${need%%:*}")
  command -v "${need%%:*}" >/dev/null 2>&1 || missing+=("${need#*:}")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "setup-test-machine: present, nothing to install: ${commands[*]}"
  exit 0
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
