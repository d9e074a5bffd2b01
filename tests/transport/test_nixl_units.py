"""Parts of ``refit.transport.nixl`` that need no NIXL install: UCX transport lists and the missing-extra error."""

from __future__ import annotations

import pytest

from refit.transport import nixl


@pytest.mark.parametrize("tls, want", [
    (None, None),
    ("", ""),
    ("tcp", "tcp,cuda_copy,cuda_ipc"),
    ("rc, sm ,self", "rc,sm,self,cuda_copy,cuda_ipc"),
    ("tcp,cuda_copy", "tcp,cuda_copy"),  # names a CUDA transport: the user chose
    ("^cuda_ipc", "^cuda_ipc"),  # an exclusion list keeps the rest
    ("all", "all"),
    ("rc,gdr_copy", "rc,gdr_copy"),
])
def test_host_only_ucx_tls_gets_the_cuda_transports(tls, want):
    assert nixl.gpu_ucx_tls(tls) == want


def test_apply_gpu_tls_edits_only_a_host_only_list():
    env = {"UCX_TLS": "tcp"}
    nixl.apply_gpu_tls(env)
    assert env["UCX_TLS"] == "tcp,cuda_copy,cuda_ipc"
    env = {}
    nixl.apply_gpu_tls(env)
    assert "UCX_TLS" not in env


def test_missing_nixl_says_how_to_install(monkeypatch):
    monkeypatch.setattr(nixl, "NIXL_MODULES", ("refit_no_such_nixl_module",))
    assert not nixl.nixl_available()
    with pytest.raises(nixl.NixlUnavailable, match=r"pip install 'refit\[nixl\]'"):
        nixl.NixlChannel(0)
    with pytest.raises(ImportError):  # also an ImportError, for callers that probe optional deps
        nixl.load_nixl()
