"""The Dockerfile, .dockerignore and entrypoint.sh, checked without a Docker engine (CI has none).

The Dockerfile is parsed (continuations, comments, JSON and shell forms) and held to the deploy contract:
the Neuron base the graph was compiled with, only requirements.txt installed on top and never a torch,
our entrypoint instead of the base image's, the port, the volume, the health check, both NeuronCores.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = "public.ecr.aws/neuron/pytorch-inference-neuronx:2.9.0-neuronx-py312-sdk2.31.1-ubuntu24.04"


@dataclass(frozen=True)
class Instruction:
    name: str  # upper case
    args: str  # the rest of the logical line, continuations joined

    def json_args(self) -> list[str] | None:
        try:
            value = json.loads(self.args)
        except ValueError:
            return None
        return value if isinstance(value, list) else None


def parse_dockerfile(text: str) -> list[Instruction]:
    """Logical instructions: comments dropped, `\\` continuations joined (comment lines inside them skipped)."""
    instructions: list[Instruction] = []
    buffer = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, even in the middle of a continued instruction
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        logical = (buffer + line).strip()
        buffer = ""
        name, _, args = logical.partition(" ")
        instructions.append(Instruction(name.upper(), args.strip()))
    assert not buffer, "the Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text(encoding="utf-8"))


def _all(instructions: list[Instruction], name: str) -> list[Instruction]:
    return [i for i in instructions if i.name == name]


def _env(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instruction in _all(instructions, "ENV"):
        for token in shlex.split(instruction.args):
            key, sep, value = token.partition("=")
            assert sep, f"use ENV KEY=VALUE, got {instruction.args!r}"
            env[key] = value
    return env


def test_base_image_is_the_neuron_stack_the_graph_was_compiled_with(dockerfile: list[Instruction]) -> None:
    froms = _all(dockerfile, "FROM")
    assert [f.args for f in froms] == [BASE_IMAGE]
    assert dockerfile[0].name == "FROM"


def test_entrypoint_replaces_the_base_images_and_cmd_is_reset(dockerfile: list[Instruction]) -> None:
    entrypoints = _all(dockerfile, "ENTRYPOINT")
    assert entrypoints and entrypoints[-1].json_args() == ["/app/entrypoint.sh"]
    cmds = _all(dockerfile, "CMD")
    assert cmds and cmds[-1].json_args() == [], "an inherited CMD would be passed to our entrypoint as arguments"
    copies = [c.args.split() for c in _all(dockerfile, "COPY")]
    assert ["entrypoint.sh", "/app/entrypoint.sh"] in copies
    assert ["server/", "/app/server/"] in copies
    assert _all(dockerfile, "WORKDIR")[-1].args == "/app"


def test_port_volume_and_environment(dockerfile: list[Instruction]) -> None:
    exposed = {port for e in _all(dockerfile, "EXPOSE") for port in e.args.split()}
    assert exposed == {"8080"}
    volumes = [v.json_args() or v.args.split() for v in _all(dockerfile, "VOLUME")]
    assert ["/data"] in volumes
    env = _env(dockerfile)
    assert env["NEURON_RT_VISIBLE_CORES"] == "0-1", "the TP=2 graph needs both NeuronCores (AWS documents the range form)"
    assert env["HOST"] == "0.0.0.0"
    assert env["GEMMA4_OPTB_CACHE"].startswith(env["ARTIFACTS_DIR"] + "/"), "start-up caches must outlive the container"
    assert env["PORT"] == "8080"
    assert env["ARTIFACTS_DIR"] == "/data"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["MALLOC_ARENA_MAX"] == "2", "the soak's heap creep halves with two arenas (docs/operations.md)"


def test_healthcheck_probes_health_with_a_start_period_for_the_first_load(dockerfile: list[Instruction]) -> None:
    checks = _all(dockerfile, "HEALTHCHECK")
    assert len(checks) == 1
    args = checks[0].args
    options, _, command = args.partition(" CMD ")
    assert command, "HEALTHCHECK needs a CMD"
    assert "/health" in command and ("${PORT" in command or "8080" in command)
    found = re.search(r"--start-period=(\d+)([smh])", options)
    assert found, "the first start downloads tens of GB and loads the graph: it needs a start period"
    seconds = int(found[1]) * {"s": 1, "m": 60, "h": 3600}[found[2]]
    assert seconds >= 20 * 60, "download + verification + a ~112 s graph load do not fit in less"
    assert re.search(r"--timeout=\d+s", options) and re.search(r"--interval=\d+s", options)


def _pip_installs(dockerfile: list[Instruction]) -> list[list[str]]:
    """The arguments of every `pip install` in RUN instructions (commands split on && ; |)."""
    installs = []
    for run in _all(dockerfile, "RUN"):
        for command in re.split(r"&&|;|\|\|?", run.args):
            words = command.split()
            for index in range(len(words) - 1):
                if re.fullmatch(r"(python3?\s*-m\s*)?pip3?", words[index]) and words[index + 1] == "install":
                    installs.append(words[index + 2:])
    return installs


def test_only_requirements_txt_is_installed_and_never_a_torch(dockerfile: list[Instruction]) -> None:
    installs = _pip_installs(dockerfile)
    assert len(installs) == 1, installs
    args = installs[0]
    assert args[args.index("-r") + 1] == "/app/requirements.txt"
    packages = [a for i, a in enumerate(args) if not a.startswith("-") and args[i - 1] not in ("-r", "-c")]
    assert packages == [], f"pip installs {packages} beside requirements.txt"
    assert "-c" in args, "the image's torch must be pinned by a constraint so nothing can replace it"
    assert not any("apt-get install" in r.args or "conda install" in r.args for r in _all(dockerfile, "RUN"))

    requirements = (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
    names = [re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower() for line in requirements
             if line.strip() and not line.lstrip().startswith("#")]
    assert not [n for n in names if n == "torch" or n.startswith(("torch-", "torch_", "torchvision"))], names


def _ignored(patterns: list[str], path: str) -> bool:
    """.dockerignore semantics, enough for our file: last match wins, `!` re-includes, a match on a parent
    directory covers everything under it, `*` stays within one path segment and `**` crosses them."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        index = 0
        while index < len(pattern):
            if pattern.startswith("**", index):
                out += ".*"
                index += 2
            elif pattern[index] == "*":
                out += "[^/]*"
                index += 1
            else:
                out += re.escape(pattern[index])
                index += 1
        return re.compile(out + "$")

    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        if any(regex(pattern).match(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_sends_only_what_the_image_copies() -> None:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    for needed in ("requirements.txt", "entrypoint.sh", "server/__main__.py", "server/app/serve.py",
                   "server/graphs/jit.py", "server/app/static/chat.html"):
        assert not _ignored(patterns, needed), needed
    for unwanted in (".git/config", "tests/test_fetch.py", "server/__pycache__/fetch.cpython-311.pyc",
                     "data/sqz_neff.pt", ".venv/bin/python"):
        assert _ignored(patterns, unwanted), unwanted


def test_entrypoint_is_executable_bash_with_strict_mode() -> None:
    script = ROOT / "entrypoint.sh"
    assert os.access(script, os.X_OK), "git must carry the executable bit (the image also chmods it)"
    text = script.read_text(encoding="utf-8")
    assert text.startswith("#!/usr/bin/env bash\n") or text.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in text
    assert re.search(r'^exec "\$PYTHON" -m server serve ', text, re.MULTILINE), "serve must be exec'd"


def test_entrypoint_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("shellcheck is not installed; the README's test command installs it (scripts/setup-test-machine.sh)")
        pytest.skip("shellcheck is not installed (bash scripts/setup-test-machine.sh installs it); CI runs this")
    result = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(ROOT / "entrypoint.sh")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
