"""The llama_memory tool: it reads XLA's memory-usage report of a llama_real step into buffers with their sizes and
shapes, largest first, and writes a headed report (run here on the tiny model, CPU)."""

import os
import pathlib
import subprocess
import sys

from jaxgrad.bench.llama_memory import parse_memory_report

ROOT = pathlib.Path(__file__).resolve().parents[1]

REPORT = """Memory Space: default (color=0)
Total bytes: 98304 (96.0KiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    32.0KiB(100%);    32.0KiB;            0;                1; f32[128,64]

  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    1.5MiB(100%);    1.5MiB;            0;                2; 2×u8[786432]
    1.5MiB(100%);    16.0KiB;            1572864;                1; f32[64,64]
Memory Space: host (color=5)
Total bytes: 2097152 (2.0MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    2.0MiB(100%);    2.0MiB;            0;                1; bf16[1024,1024]
"""


def test_the_report_is_read_into_buffers_largest_first_with_their_memory_space():
    rows = parse_memory_report(REPORT)
    assert rows[0] == (2 * 2**20, "host (color=5)", "bf16[1024,1024]")
    assert rows[1] == (int(1.5 * 2**20), "default (color=0)", "2×u8[786432]")
    assert [r[0] for r in rows] == sorted((r[0] for r in rows), reverse=True) and len(rows) == 4


def test_the_tool_writes_a_headed_report_of_the_tiny_step(tmp_path):
    cmd = [sys.executable, "-m", "jaxgrad.bench", "llama_memory", "--model", "8b", "--qlora", "--tiny", "--layers", "1",
           "--variant", "jaxgrad recompute=all", "--top", "5", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.glob("llama_memory_8b_qlora_tiny-cpu-*.txt")
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# device: cpu") and "commit" in lines[1] and "llama_memory" in lines[1]
    assert any(line.startswith("jaxgrad recompute=all: arguments") for line in lines)
    listed = [line for line in lines if line.startswith("  ") and "[" in line]
    assert 1 <= len(listed) <= 5


def test_a_variant_that_is_not_jaxgrads_is_refused():
    proc = subprocess.run([sys.executable, "-m", "jaxgrad.bench", "llama_memory", "--model", "1b", "--variant",
                           "transformers+PEFT"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and "--variant must be a jaxgrad variant" in proc.stderr
