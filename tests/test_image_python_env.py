"""The image's Python environment: what requirements.txt installs must not break what the Neuron base declares.

No Neuron image runs here, so this is `pip check` done offline: the base image's Neuron packages are modelled by
the requirements they declare (copied below from their published setup.py, with where they come from), the
Dockerfile says which of them it removes, and what we install is what pip resolved requirements.txt to in this
environment (CI installs requirements.txt the same way), closed over its own dependencies. Each requirement an
image package keeps must be met by the version we install, and each of our dependencies' requirements on the
image's pinned torch must admit the image's torch. The Dockerfile repeats the real `pip check` at build time.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.test_docker import _all, parse_dockerfile

ROOT = Path(__file__).resolve().parents[1]

# Requires-Dist of the base image's Neuron packages (pytorch-inference-neuronx 2.9.0, SDK 2.31.1).
IMAGE_DECLARES = {
    # aws-neuron/neuronx-distributed setup.py install_requires: no transformers (it imports transformers.utils.fx
    # when transformers is present, which server/vendor/neuron_prelude.py stands in for under transformers 5).
    "neuronx-distributed": ["torch-neuronx", "torch-xla", "safetensors"],
    # aws-neuron/neuronx-distributed-inference setup.py install_requires; SDK 2.31's release pins transformers 4.57.
    "neuronx-distributed-inference": ["neuronx_distributed", "transformers==4.57.*", "sentencepiece"],
}
IMAGE_TORCH = Version("2.9.0")  # the base image's tag: pytorch-inference-neuronx:2.9.0-...


def requirement_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(canonicalize_name(Requirement(line).name))
    return names


def installed_closure(roots: list[str]) -> dict[str, Version]:
    """{package: version} of the roots and everything they require (markers evaluated, extras not taken)."""
    env = {**default_environment(), "extra": ""}
    seen: dict[str, Version] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional dependency pip did not install
        seen[name] = Version(dist.version)
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(canonicalize_name(req.name))
    return seen


def removed_by_dockerfile() -> set[str]:
    removed: set[str] = set()
    for run in _all(parse_dockerfile((ROOT / "Dockerfile").read_text(encoding="utf-8")), "RUN"):
        for match in re.finditer(r"pip3? uninstall ((?:-\S+\s+)*)([^&|;]+)", run.args):
            removed |= {canonicalize_name(word) for word in match[2].split() if not word.startswith("-")}
    return removed


def test_nothing_we_install_breaks_what_the_images_packages_declare() -> None:
    ours = installed_closure(requirement_names(ROOT / "requirements.txt"))
    assert ours["transformers"] >= Version("5.5"), "Gemma-4 needs transformers 5"
    kept = {name: reqs for name, reqs in IMAGE_DECLARES.items() if canonicalize_name(name) not in removed_by_dockerfile()}
    assert "neuronx-distributed" in kept, "the server and the recipe load graphs through NxD: it must stay"
    broken = [
        f"{package} requires {req}, we install {req.name} {ours[canonicalize_name(req.name)]}"
        for package, reqs in kept.items()
        for req in map(Requirement, reqs)
        if canonicalize_name(req.name) in ours and not req.specifier.contains(ours[canonicalize_name(req.name)], True)
    ]
    assert broken == []


def test_our_dependencies_accept_the_images_torch() -> None:
    ours = installed_closure(requirement_names(ROOT / "requirements.txt"))
    env = {**default_environment(), "extra": ""}
    refused = [
        f"{name} requires {raw}"
        for name in ours
        for raw in md.distribution(name).requires or []
        if (req := Requirement(raw)).name == "torch" and (req.marker is None or req.marker.evaluate(env))
        and not req.specifier.contains(IMAGE_TORCH, True)
    ]
    assert refused == []


def test_the_build_runs_pip_check_before_and_after_our_install() -> None:
    runs = [r.args for r in _all(parse_dockerfile((ROOT / "Dockerfile").read_text(encoding="utf-8")), "RUN")]
    install = next(r for r in runs if "-r /app/requirements.txt" in r)
    steps = [s.strip() for s in install.split("&&")]
    where = {name: next(i for i, s in enumerate(steps) if pattern in s) for name, pattern in {
        "check_base": "pip check > /tmp/pip-check-base.txt", "uninstall": "pip uninstall -y",
        "install": "pip install -c", "check_ours": "pip check > /tmp/pip-check-ours.txt", "compare": "comm -13",
    }.items()}
    assert where["check_base"] < where["uninstall"] < where["install"] < where["check_ours"] < where["compare"]
    assert "exit 1" in steps[where["compare"]], "a report our install added must fail the build"
    pinned = re.search(r"grep -iE '\^\((.*?)\)==", install)[1].split("|")
    assert {"torch", "torch[-_]xla", "torch[-_]neuronx", "neuronx[-_]distributed", "numpy"} <= set(pinned)


def test_the_build_imports_nxd_through_the_prelude_after_our_install() -> None:
    runs = [r.args for r in _all(parse_dockerfile((ROOT / "Dockerfile").read_text(encoding="utf-8")), "RUN")]
    install = next(i for i, r in enumerate(runs) if "-r /app/requirements.txt" in r)
    probe = [i for i, r in enumerate(runs) if "from server.vendor.neuron_prelude import prepare_neuron_imports" in r]
    assert probe and probe[0] > install, "NxD must be proven importable beside transformers 5 at build time"
