"""scripts/setup.sh picks JAX's CUDA build when nvidia-smi lists a GPU, and only then (checked with a fake nvidia-smi
and the script's dry-run mode, which installs nothing)."""

import os
import pathlib
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _fake_nvidia_smi(tmp_path, output: str, status: int = 0) -> str:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\necho '{output}'\nexit {status}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(bindir)


def _setup(path_prefix: str | None, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k != "JAXGRAD_CUDA"}
    e.update(JAXGRAD_SETUP_DRY_RUN="1", **env)
    if path_prefix:
        e["PATH"] = path_prefix + os.pathsep + e["PATH"]
    else:  # hide any real nvidia-smi
        e["PATH"] = os.pathsep.join(p for p in e["PATH"].split(os.pathsep)
                                    if not (pathlib.Path(p) / "nvidia-smi").exists())
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=e, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout


def test_a_gpu_listed_by_nvidia_smi_selects_the_cuda_extra(tmp_path):
    fake = _fake_nvidia_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)")
    out = _setup(fake)
    assert "pip install -e .[dev,cuda]" in out and "a GPU is present" in out


def test_no_nvidia_smi_means_the_cpu_build(tmp_path):
    assert "pip install -e .[dev]\n" in _setup(None)


def test_an_nvidia_smi_that_finds_no_gpu_means_the_cpu_build(tmp_path):
    fake = _fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed because it couldn't communicate with the driver", 9)
    assert "pip install -e .[dev]\n" in _setup(fake)


@pytest.mark.parametrize("value, extras", [("0", "dev"), ("1", "dev,cuda")])
def test_jaxgrad_cuda_overrides_the_choice(tmp_path, value, extras):
    fake = _fake_nvidia_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)")
    assert f"pip install -e .[{extras}]\n" in _setup(fake if value == "0" else None, JAXGRAD_CUDA=value)


def test_the_cuda_extra_pins_jax_to_the_package_version():
    text = (ROOT / "pyproject.toml").read_text()
    pinned = [line for line in text.splitlines() if line.startswith('  "jax==')][0].split("==")[1].rstrip('",')
    assert f'cuda = ["jax[cuda13]=={pinned}"]' in text
