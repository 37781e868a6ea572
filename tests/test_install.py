"""A non-editable install (pip install .) is complete: presets and the bundled corpus ship inside the package."""

import os
import shutil
import site
import subprocess
import sys
import tarfile
import venv

import pytest
import yaml
from helpers import ROOT


@pytest.mark.slow
def test_presets_ship_with_a_non_editable_install(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(
        ROOT, src, symlinks=True,
        ignore=shutil.ignore_patterns(".git", "runs", "data", "build", "*.egg-info", "__pycache__", ".pytest_cache"),
    )
    # The dependencies come from this interpreter's site-packages, after the venv's own (as with
    # system_site_packages, which would give a venv's base interpreter's instead when the suite runs in a venv);
    # lm itself is installed into the venv, as a copy.
    venv.create(tmp_path / "venv", with_pip=True)
    bindir = tmp_path / "venv" / "bin"
    purelib = subprocess.run([bindir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    with open(os.path.join(purelib, "parent_site.pth"), "w") as f:
        user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []  # pip install --user's, where enabled
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in [*site.getsitepackages(), *user])
    install = subprocess.run([bindir / "python", "-m", "pip", "install", "--no-deps", "-q", str(src)],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    shutil.rmtree(src)  # nothing may be read from the source tree any more
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # what is tested is the installed copy, the same on any backend
    # PYTHONPATH may bring dependencies (the GPU machine's), but no entry that holds an lm of its own.
    paths = [d for d in env.pop("PYTHONPATH", "").split(os.pathsep) if d and not os.path.isdir(os.path.join(d, "lm"))]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)

    def run(*args):
        proc = subprocess.run([str(a) for a in args], cwd=work, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    where = run(bindir / "python", "-c", "import lm.config as c; print(c.__file__); print(c.find_preset('tiny'))")
    assert all(line.startswith(str(tmp_path / "venv")) for line in where.split()), where
    help_text = run(bindir / "lm-train", "--help")
    assert "configs/tiny.yaml" in help_text and help_text.startswith("usage: lm-train ")  # (it said train.py)
    common = [f"data.cache_dir={work / 'data'}", "logging.progress=false", "train.peak_flops=1e12", "train.steps=2"]
    out = run(bindir / "lm-train", "tiny", f"run.dir={work / 'tiny'}", *common)
    assert "sample with: lm-sample tiny\n" in out  # the installed command, not the checkout's script
    saved = yaml.safe_load((work / "tiny" / "config.yaml").read_text())
    assert saved["model"]["n_layer"] == 2 and saved["data"]["batch_size"] == 8  # tiny's, not the defaults
    # No preset: configs/default.yaml (batch 16, where the dataclass default is 32), never the bare defaults.
    run(bindir / "lm-train", f"run.dir={work / 'default'}", "data.tokenizer=bytes", "model.n_layer=1", *common)
    assert yaml.safe_load((work / "default" / "config.yaml").read_text())["data"]["batch_size"] == 16


def test_a_missing_extra_names_a_pip_command_that_works_where_lm_is_installed():
    """`pip install -e '.[serve]'` works in the checkout only: from any other directory pip says there is no
    project there. `pip install 'lm[serve]'` installs the extra's packages beside any install of lm (editable or
    not), so that is what a message about a missing extra names."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "lm")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    found += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1) if "-e '.[" in line]
    assert not found, found


def test_the_sdist_holds_no_test_it_cannot_run(tmp_path):
    """The sdist took tests/test_*.py (setuptools' default) without their conftest.py, helpers.py and fixtures,
    1.1 MB of tests that fail at collection (No module named 'helpers'); it holds the package alone."""
    pytest.importorskip("setuptools")  # (pip builds lm in an isolated environment: a venv may have none of its own)
    src = tmp_path / "src"
    skip = [".git", "runs", "data", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "venv", ".venv"]
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(*skip))
    done = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "sdist", "-d",
                           str(tmp_path / "dist")], cwd=src, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").iterdir()
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert "lm/configs/tiny.yaml" in names and "lm/assets/tinyshakespeare.txt" in names
    assert not [n for n in names if n.startswith("tests/")], names
