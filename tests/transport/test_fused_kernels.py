"""The fused Triton kernels of the GPU paths, run on this machine's CPU under Triton's interpreter.

The kernels (``refit.transport.triton_kernels``) copy and checksum in one pass and quantize
to FP8 in one pass; on a GPU they replace eager copies, checksum passes and a five-pass
quantizer. Their sums must equal ``ChecksumLedger``'s bit for bit (a fused sender and an
unfused receiver compare them), and their FP8 must equal ``quantize_reference``. Each check
runs in a subprocess with ``TRITON_INTERPRET=1``: ``make install`` puts Triton in
``.venv/triton-interpreter``, apart from the packages vLLM imports, since a CPU vLLM that
finds Triton tries to use it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.transport.copy_sum import CONTIGUOUS_RUN, fused_enabled, side_layout

REPO = Path(__file__).resolve().parents[2]
TRITON_DIR = Path(sys.prefix) / "triton-interpreter"


def interpreter_env() -> dict[str, str]:
    paths = [str(REPO)]
    if importlib.util.find_spec("triton") is None:
        if not (TRITON_DIR / "triton").is_dir():
            pytest.fail(f"Triton is not importable and {TRITON_DIR} holds none: `make install` puts it there")
        paths.insert(0, str(TRITON_DIR))
    env = dict(os.environ, TRITON_INTERPRET="1", REFIT_FUSED="1")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.mark.parametrize("check, done", [("copy_sum_check", "copy_sum: ok"), ("quantize_check", "quantize: ok")])
def test_the_fused_kernel_equals_the_unfused_path_bit_for_bit(check: str, done: str) -> None:
    """Copies, row sums (per block and packed with gaps), refusals; FP8 weights, scales and amaxes."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / f"{check}.py"), "cpu"],
                          env=interpreter_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == done


def test_the_fused_path_is_for_gpus_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not fused_enabled(torch.device("cpu"))
    monkeypatch.setenv("REFIT_FUSED", "0")
    assert not fused_enabled(torch.device("cuda", 0))


def _bytes_by_layout(base: torch.Tensor, view: torch.Tensor) -> bytes:
    """``view``'s bytes in row-major order, read from ``base``'s memory by ``side_layout``'s runs."""
    layout = side_layout(view)
    raw = base.reshape(-1).view(torch.uint8)
    start = layout.address - base.data_ptr()
    nbytes = view.numel() * view.element_size()
    if layout.run == CONTIGUOUS_RUN:
        return bytes(raw[start:start + nbytes].tolist())
    out = bytearray()
    for pos in range(start, start + (nbytes // layout.run) * layout.stride, layout.stride):
        out += bytes(raw[pos:pos + layout.run].tolist())
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 12), depth=st.integers(1, 3), r0=st.integers(0, 8),
       c0=st.integers(0, 11), c1=st.integers(1, 12), dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8]))
def test_a_view_taken_as_runs_reads_exactly_its_bytes(rows, cols, depth, r0, c0, c1, dtype) -> None:
    """Whatever slice of a stack of matrices: either refused, or its runs are its bytes in order."""
    base = torch.arange(depth * rows * cols * 8, dtype=torch.int64).to(dtype).reshape(depth, rows, cols * 8)
    view = base[:, min(r0, rows - 1):, min(c0, c1 - 1) * 8: c1 * 8]
    layout = side_layout(view)
    if layout is None or not view.numel():
        return
    assert layout.address % 8 == 0
    assert _bytes_by_layout(base, view) == bytes(view.contiguous().reshape(-1).view(torch.uint8).tolist())
