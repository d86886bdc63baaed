"""The package builds, passes `twine check`, and its wheel installs and imports.

The sdist and the wheel are built from the source tree with `python -m build` (no
isolation: hatchling comes from the test environment, so nothing is downloaded), checked
with `twine check --strict`, and the wheel is installed with `pip --no-deps --no-index`
into a fresh virtual environment that sees the test environment's packages (JAX,
Equinox, Flax) but not the source tree; there `chunkvmap` and its adapters are imported
from a directory outside the repository, with no PYTHONPATH.
"""

from __future__ import annotations

import email.parser
import importlib.util
import json
import os
import pathlib
import site
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import tomllib
import venv
import zipfile

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
TIMEOUT_S = 120


@pytest.fixture(scope="module", autouse=True)
def tools():
    for tool in ("build", "twine", "hatchling"):
        assert importlib.util.find_spec(tool), f"{tool} is installed by the tests extra"


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(
            args, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[:4]} did not finish in {TIMEOUT_S}s")
    assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="chunkvmap-packaging-") as tmp:
        yield pathlib.Path(tmp)
    # the directory, the built files and the venv are removed here


@pytest.fixture(scope="module")
def dist(workdir) -> dict[str, pathlib.Path]:
    out = workdir / "dist"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run(
        [
            sys.executable,
            "-m",
            "build",
            "--no-isolation",
            "--outdir",
            str(out),
            str(ROOT),
        ],
        cwd=workdir,
        env=env,
    )
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"chunkvmap-{VERSION}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"chunkvmap-{VERSION}.tar.gz"]
    return {"wheel": wheels[0], "sdist": sdists[0]}


def test_twine_check_passes(dist):
    result = run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.values())]
    )
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_wheel_and_sdist_hold_the_package_and_its_metadata(dist):
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        metadata = email.parser.Parser().parsestr(
            wheel.read(f"chunkvmap-{VERSION}.dist-info/METADATA").decode()
        )
    source = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "chunkvmap").iterdir()
        if p.suffix in (".py", ".typed")
    }
    assert source <= names, sorted(source - names)
    assert not {n for n in names if n.startswith(("tests/", "docs/", "examples/"))}
    assert metadata["Name"] == "chunkvmap" and metadata["Version"] == VERSION
    assert metadata["Requires-Python"] == PYPROJECT["project"]["requires-python"]
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"equinox", "flax", "progress"} <= extras, extras
    requires = metadata.get_all("Requires-Dist")
    assert "jax>=0.10.2" in requires, requires
    assert "equinox>=0.13; extra == 'equinox'" in requires, requires
    assert "flax>=0.12; extra == 'flax'" in requires, requires
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert "jax.vmap" in metadata.get_payload()  # the README is the long description
    with tarfile.open(dist["sdist"]) as sdist:
        files = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", *source} <= files, sorted(files)
    # the license the metadata names ships with the wheel
    assert f"chunkvmap-{VERSION}.dist-info/licenses/LICENSE" in names, sorted(names)
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


IMPORT_CHECK = """
import importlib.metadata, json, jax.numpy as jnp
import chunkvmap, chunkvmap.eqx, chunkvmap.linen, chunkvmap.nnx
y = chunkvmap.batch_vmap(jnp.sum, batch_size=2)(jnp.arange(10.0).reshape(5, 2))
print(json.dumps({
    "version": chunkvmap.__version__,
    "metadata_version": importlib.metadata.version("chunkvmap"),
    "files": [m.__file__ for m in (chunkvmap, chunkvmap.eqx, chunkvmap.linen,
                                   chunkvmap.nnx)],
    "y": y.tolist(),
}))
"""


def test_wheel_installs_into_a_fresh_venv_and_imports(dist, workdir):
    env_dir = workdir / "venv"
    # --system-site-packages shows the base interpreter's packages; when the tests run
    # in a virtual environment (`make test`), a .pth file adds its site-packages too,
    # so JAX, Equinox and Flax come from the test environment: nothing is downloaded.
    venv.create(env_dir, system_site_packages=True, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    purelib = pathlib.Path(
        sysconfig.get_path(
            "purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}
        )
    )
    assert purelib.is_dir(), purelib
    (purelib / "_test_environment.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--no-cache-dir",
            "--quiet",
            str(dist["wheel"]),
        ],
        cwd=workdir,
        env=clean,
    )
    outside = workdir / "elsewhere"
    outside.mkdir()
    result = run([str(python), "-c", IMPORT_CHECK], cwd=outside, env=clean)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["version"] == found["metadata_version"] == VERSION, found
    for file in found["files"]:
        path = pathlib.Path(file).resolve()
        assert env_dir.resolve() in path.parents, file  # the installed copy...
        assert ROOT not in path.parents, file  # ...not the source tree
    assert found["y"] == [1.0, 5.0, 9.0, 13.0, 17.0], found


def test_install_instructions_name_the_wheel_that_is_built(dist):
    for page in ("README.md", "docs/index.md"):
        text = (ROOT / page).read_text()
        assert f'pip install "dist/{dist["wheel"].name}[flax,equinox]"' in text, page
        assert "Once published" in text, page  # `pip install chunkvmap` is not yet
