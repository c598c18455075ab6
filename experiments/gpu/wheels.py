"""The wheels a borrowed GPU needs, computed rather than listed by hand (`make gpu-wheels`), and their installation
there (experiments/gpu/run.sh).

    python experiments/gpu/wheels.py plan IMPORTS                 # what the GPU script imports that the image lacks
    python experiments/gpu/wheels.py download IMPORTS .whl        # ... as wheels for the device's Python, into .whl
    python experiments/gpu/wheels.py install .whl /tmp/site       # on the device: what its image lacks, into /tmp/site

The need: every distribution that the GPU script's dry run imported (IMPORTS: experiments/gpu/record's files, one per
process), at the version this project's environment holds, with every requirement on it that the installed
distributions state. The image: experiments/gpu/image.txt, the device's `pip list --format=freeze` as the last lease
wrote it (run.sh writes it into its results every time). A need is carried when the image lacks it or holds a
version that a requirement refuses; the torch stack (torch, torchvision, triton, nvidia-*, cuda-*) never is: the
image's is built for its GPU. On the device, `install` checks again against what is really installed there.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

HERE = Path(__file__).resolve().parent
IMAGE = HERE / "image.txt"
DEVICE_PYTHON = "3.12"  # the image's python3 (KINDS.md; run.sh records it with the image's packages)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64")
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|vitlab)$")  # the image's own, or ours
CARRY_LIMIT_MB = 48  # of the device tool's 64 MiB for the working tree and carried paths together
UNREAD_VERSION_MAX_MB = 3  # a version the image holds but image.txt does not say: carried up to this size (timm 2.5)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions(imports: Path) -> dict[str, str]:
    """{distribution: installed version} of the top-level modules recorded under `imports`."""
    modules = {line for f in imports.glob("*.txt") for line in f.read_text().split() if line}
    if not modules:
        raise SystemExit(f"no imports recorded under {imports}: run the dry run with experiments/gpu/record first")
    owners = metadata.packages_distributions()
    dists = {canonical(d) for m in modules for d in owners.get(m, [])}
    return {d: metadata.version(d) for d in sorted(dists) if not NEVER.match(d)}


def requirements() -> dict[str, SpecifierSet]:
    """Every requirement that this environment's distributions state, by the name required."""
    specs: dict[str, SpecifierSet] = {}
    for dist in metadata.distributions():
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": "", "python_version": DEVICE_PYTHON}):
                continue
            name = canonical(req.name)
            specs[name] = specs.get(name, SpecifierSet()) & req.specifier
    return specs


def image(path: Path = IMAGE) -> dict[str, str | None]:
    """{distribution: version or None (known to be there, version not read)} from a `pip list --format=freeze`."""
    held: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            held[canonical(name)] = version.strip() or None
    return held


def satisfies(version: str | None, spec: SpecifierSet) -> bool:
    return version is None or spec.contains(Version(version).public, prereleases=True)


def plan(imports: Path) -> tuple[dict[str, str], dict[str, SpecifierSet]]:
    """({distribution: version to carry}, the requirements on them)."""
    needed, specs, held = imported_distributions(imports), requirements(), image()
    carry = {
        name: version
        for name, version in needed.items()
        if name not in held
        or not satisfies(held[name], specs.get(name, SpecifierSet()))
        or (held[name] is None and str(specs.get(name, "")))  # a version not read, and required: the device decides
    }
    return carry, specs


def download(imports: Path, dest: Path) -> None:
    carry, specs = plan(imports)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip", "-q"]
    binary = [
        *pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
        "--implementation", "cp", *(x for p in PLATFORMS for x in ("--platform", p)), "-d", str(dest),
    ]  # fmt: skip
    for name, version in carry.items():
        pinned = f"{name}=={version}"
        if subprocess.run([*binary, pinned], capture_output=True).returncode != 0:  # an sdist only: build it here
            subprocess.run([*pip, "wheel", "--no-deps", "-w", str(dest), pinned], check=True)
    # Those the image holds at a version not read: carried for the device to choose, unless large (numpy, scipy)
    held, left = image(), []
    for wheel in list(dest.glob("*.whl")):
        name = canonical(wheel.name.split("-")[0])
        if name in held and wheel.stat().st_size > UNREAD_VERSION_MAX_MB * 2**20:
            wheel.unlink()
            left.append(carry.pop(name))
    if left:
        print(f"left to the image (a version not read, wheels over {UNREAD_VERSION_MAX_MB} MiB): {len(left)}")
    wanted = {name: {"version": v, "specifiers": str(specs.get(name, ""))} for name, v in carry.items()}
    (dest / "requirements.json").write_text(json.dumps(wanted, indent=1))
    size = sum(f.stat().st_size for f in dest.glob("*.whl")) / 2**20
    print(f"{len(carry)} wheels ({size:.1f} MiB) into {dest}: {' '.join(carry)}")
    if size > CARRY_LIMIT_MB:
        raise SystemExit(f"the wheels are {size:.0f} MiB, over {CARRY_LIMIT_MB}: the device carries 64 MiB in all")


def install(wheels: Path, target: Path) -> None:
    """On the device: the carried wheels whose distribution its image lacks or holds at a refused version."""
    wanted = json.loads((wheels / "requirements.json").read_text())
    chosen, kept = [], []
    for wheel in sorted(wheels.glob("*.whl")):
        name = canonical(wheel.name.split("-")[0])
        spec = SpecifierSet(wanted.get(name, {}).get("specifiers", ""))
        try:
            there = metadata.version(name)
        except metadata.PackageNotFoundError:
            there = None
        if there is not None and satisfies(there, spec):
            kept.append(f"{name} {there}")
        else:
            chosen.append(wheel)
    if chosen:
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--upgrade",
            "--no-index",
            "--no-deps",
            "--target",
            str(target),
        ]
        subprocess.run([*pip, *map(str, chosen)], check=True)
    print(f"installed {len(chosen)} wheels into {target}: {' '.join(w.name.split('-')[0] for w in chosen) or '-'}")
    print(f"kept the image's {len(kept)} (their versions satisfy the requirements): {', '.join(kept) or '-'}"[:600])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("plan").add_argument("imports", type=Path)
    d = sub.add_parser("download")
    d.add_argument("imports", type=Path)
    d.add_argument("dest", type=Path)
    i = sub.add_parser("install")
    i.add_argument("wheels", type=Path)
    i.add_argument("target", type=Path)
    a = p.parse_args()
    if a.verb == "plan":
        carry, _ = plan(a.imports)
        print("\n".join(f"{n}=={v}" for n, v in carry.items()))
    elif a.verb == "download":
        download(a.imports, a.dest)
    else:
        install(a.wheels, a.target)


if __name__ == "__main__":
    main()
