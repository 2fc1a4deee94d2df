"""scripts/setup.sh picks JAX's CUDA build when nvidia-smi lists a GPU, and only then (checked with a fake nvidia-smi
and the script's dry-run mode, which installs nothing); its pip steps drop pip's known noise, show everything else
and stop the set-up when pip fails (checked with a fake .venv/bin/python in a copy of the script)."""

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


def _fake_checkout(tmp_path, pip_status: int) -> pathlib.Path:
    """A copy of setup.sh in a fake checkout whose .venv/bin/python is a script: ``-c`` succeeds (the Python version
    probe; the final import line says it ran); ``-m pip`` prints pip's known noise, one real line and $PYTHONWARNINGS, and
    exits with ``pip_status``."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    py = repo / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f"""#!/bin/sh
if [ "$1" = "-c" ]; then case "$2" in *"import jax"*) echo "final import line ran";; esac; exit 0; fi
echo "WARNING: Location 'file:///opt/pypi-more/simple/jax/' is ignored: it is neither a file nor a directory."
echo "ERROR: a real pip message"
echo "PYTHONWARNINGS=$PYTHONWARNINGS"
exit {pip_status}
""")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return repo


def _run_fake_setup(repo) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("JAXGRAD_SETUP_DRY_RUN", "PYTHONWARNINGS")}
    e["JAXGRAD_CUDA"] = "0"
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], env=e, capture_output=True, text=True,
                          timeout=60)


def test_setup_filters_pips_known_noise_and_nothing_else(tmp_path):
    out = _run_fake_setup(_fake_checkout(tmp_path, 0))
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "is ignored: it is neither a file nor a directory" not in text
    assert text.count("ERROR: a real pip message") == 2  # the pip upgrade and the install: real output shows
    # setuptools' editable-install BuildBackendWarning is silenced through the environment pip hands the backend
    assert text.count("PYTHONWARNINGS=ignore:Editable installation") == 2
    assert "final import line ran" in text


def test_a_failing_pip_stops_the_setup(tmp_path):
    out = _run_fake_setup(_fake_checkout(tmp_path, 3))
    assert out.returncode == 3
    assert "final import line ran" not in out.stdout
