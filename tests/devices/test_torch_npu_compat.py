"""npu-sim seen as torch_npu: ``import torch_npu``, the guard that tells it from the real package, the
``torch.npu`` calls verl 0.9.1 and vllm-ascend make, and fused operators checked against plain torch."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import hal
from tests.devices.npu_api_names import real_names

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not hal.availability("npu-sim"),
                                reason=f"npu-sim unavailable: {hal.availability('npu-sim').reason}")

# torch.npu / torch_npu.npu attributes called by verl 0.9.1 (grep of its sources for get_torch_device().X,
# torch.npu.X, device_module.X) and by vllm-ascend (torch.npu.X in vllm_ascend/).
VERL_CALLS = {
    "empty_cache", "synchronize", "is_available", "current_stream", "set_device", "mem_get_info", "stream",
    "device_count", "current_device", "Stream", "set_rng_state", "get_rng_state", "set_per_process_memory_fraction",
    "ipc_collect", "get_device_name", "get_device_capability", "memory_reserved", "memory_allocated",
    "max_memory_reserved", "max_memory_allocated", "manual_seed_all", "manual_seed", "Event", "memory",
    "mstx",  # `from torch_npu.npu import mstx` in verl/utils/profiler/mstx_profile.py, unguarded on npu
}
VLLM_ASCEND_CALLS = {
    "current_stream", "Event", "Stream", "stream", "current_device", "set_device", "synchronize", "empty_cache",
    "mem_get_info", "device", "memory_reserved", "is_available", "device_count", "is_current_stream_capturing",
    "get_device_properties", "default_stream", "set_stream", "set_compile_mode", "reset_peak_memory_stats",
    "memory_stats", "memory_allocated", "max_memory_allocated", "get_device_name", "config",
    # absent on purpose (below): the consumer's own fallback or a clear AttributeError
    "ExternalEvent", "graph_task_update_end", "graph_task_update_begin", "graph_task_group_end",
    "graph_task_group_begin", "graph", "NPUGraph", "graph_pool_handle",
}
# Not offered: graph capture, external events and pluggable allocators need a driver the sim does not model.
ABSENT_ON_PURPOSE = {"ExternalEvent", "graph_task_update_end", "graph_task_update_begin", "graph_task_group_end",
                     "graph_task_group_begin", "graph", "NPUGraph", "graph_pool_handle", "MemPool",
                     "NPUPluggableAllocator", "use_mem_pool", "memory_snapshot"}
# Submodules of torch_npu.npu (files under torch_npu/npu/ in the 2.14.0 wheel), not in the __init__ name list.
SUBMODULES = {"memory"}


def _run(code: str, env_extra: dict | None = None, cwd: pathlib.Path = REPO, pythonpath: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("HAL_DEVICE", "PYTHONPATH")}
    env.update(env_extra or {})
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=cwd)


def test_import_torch_npu_gives_the_sim_with_a_real_spec():
    import torch_npu
    import torch_npu.npu

    assert torch_npu.npu is torch.npu and sys.modules["torch_npu.npu"] is torch.npu
    assert torch_npu.__version__ == "2.14.0+hal.sim" and torch_npu.__hal_sim__ is True
    spec = importlib.util.find_spec("torch_npu")
    assert spec is torch_npu.__spec__ and spec.name == "torch_npu"
    assert spec.origin == str(REPO / "devices" / "npu_sim" / "torch_npu.py") and spec.submodule_search_locations == []
    with pytest.raises(ModuleNotFoundError, match="torch_npu.profiler"):
        import torch_npu.profiler
    assert not hasattr(torch_npu, "npu_grouped_matmul") and not hasattr(torch_npu, "_C")


def test_compat_module_is_not_taken_for_the_real_package():
    import torch_npu

    from devices import npu_sim as sim
    from devices.npu_sim import compat as sim_compat

    assert sim_compat.is_compat(torch_npu) and sim_compat.real_torch_npu_origin() is None
    assert not sim.real_torch_npu_present()
    hal.reset()  # an earlier test of this worker may have probed npu before the sim registered
    state = hal.availability("npu")  # the real-hardware kind refuses the compatibility module
    assert not state and "npu-sim compatibility module" in state.reason


def test_empty_torch_npu_folder_on_pythonpath_is_not_a_real_torch_npu(tmp_path):
    (tmp_path / "torch_npu").mkdir()
    out = _run("""
        import importlib.util, hal
        from devices import npu_sim as sim
        print("REAL", sim.real_torch_npu_present())
        print("AVAIL", bool(hal.availability("npu-sim")))
        import torch, torch_npu
        print("COMPAT", torch_npu.__hal_sim__, torch_npu.npu is torch.npu)
    """, pythonpath=f"{tmp_path}{os.pathsep}{REPO}")
    assert out.returncode == 0, out.stderr
    assert "REAL False" in out.stdout and "AVAIL True" in out.stdout and "COMPAT True True" in out.stdout


def test_a_package_shaped_like_the_wheel_is_taken_for_real(tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('the guard must not import torch_npu')\n")
    (pkg / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # what the torch-npu wheel ships
    out = _run("""
        import hal
        from devices import npu_sim as sim
        print("REAL", sim.real_torch_npu_present())
        print("REASON", hal.availability("npu-sim").reason)
    """, pythonpath=f"{tmp_path}{os.pathsep}{REPO}")
    assert out.returncode == 0, out.stderr
    assert "REAL True" in out.stdout
    assert f"a real torch_npu is importable here ({pkg / '__init__.py'})" in out.stdout


def test_every_torch_npu_call_of_verl_and_vllm_ascend_is_offered_or_absent_on_purpose():
    npu = torch.npu
    listed = real_names() | SUBMODULES
    called = VERL_CALLS | VLLM_ASCEND_CALLS
    assert called <= listed, f"not in torch_npu 2.14.0: {sorted(called - listed)}"
    missing = sorted(n for n in called - ABSENT_ON_PURPOSE if not hasattr(npu, n))
    assert not missing, f"torch.npu lacks names verl / vllm-ascend call: {missing}"
    stray = sorted(n for n in ABSENT_ON_PURPOSE if hasattr(npu, n))
    assert not stray, f"offered although not implemented: {stray}"
    offered = sorted(n for n in real_names() if hasattr(npu, n))
    print(f"\ntorch.npu coverage: {len(offered)} of {len(real_names())} torch_npu 2.14.0 names "
          f"({100 * len(offered) / len(real_names()):.0f}%); verl+vllm-ascend calls: "
          f"{len(called - ABSENT_ON_PURPOSE)} of {len(called)} offered, the rest absent on purpose")


def test_per_process_memory_fraction_limits_allocation():
    npu = torch.npu
    free, total = npu.mem_get_info()
    base = npu.memory_allocated()
    assert npu.get_per_process_memory_fraction() == 1.0
    fraction = (base + (4 << 20)) / total
    npu.set_per_process_memory_fraction(fraction)
    try:
        assert npu.get_per_process_memory_fraction() == fraction
        assert npu.mem_get_info()[1] == total  # the device total is unchanged, as the driver reports it
        keep = torch.empty(3 << 20, dtype=torch.uint8, device="npu")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 << 20, dtype=torch.uint8, device="npu")
        del keep
        with pytest.raises(ValueError, match="Allowed range"):
            npu.set_per_process_memory_fraction(1.5)
        with pytest.raises(TypeError, match="float"):
            npu.set_per_process_memory_fraction(1)
    finally:
        npu.set_per_process_memory_fraction(1.0)
    big = torch.empty(8 << 20, dtype=torch.uint8, device="npu")
    assert npu.memory_allocated() == base + (8 << 20)
    del big


def test_device_queries_and_allocator_settings():
    npu = torch.npu
    assert npu.get_device_capability() is None and npu.get_device_capability(1) is None
    props = npu.get_device_properties(0)
    assert props.total_memory == npu.mem_get_info(0)[1] and props.name == npu.get_device_name(0)
    assert npu.ipc_collect() is None and npu.is_current_stream_capturing() is False
    assert npu.config.allow_internal_format is False
    from torch_npu.npu import mstx

    first, second = mstx.range_start("a"), mstx.range_start("b")
    assert isinstance(first, int) and second > first and mstx.range_end(first) is None
    assert mstx.mstx_range("f")(lambda x: x + 1)(1) == 2
    npu.memory._set_allocator_settings("expandable_segments:True,max_split_size_mb:128")
    assert npu.memory._allocator_settings()["expandable_segments"] == "True"
    with pytest.raises(RuntimeError, match="Unrecognized key 'bogus'"):
        npu.memory._set_allocator_settings("bogus:1")
    import torch.npu.memory as memory

    assert memory is npu.memory and memory.memory_allocated is npu.memory_allocated


# ---- fused operators: each against an independent plain-torch reference, on npu tensors -----------------

def _close(a, b, **kw):
    torch.testing.assert_close(a.cpu(), b.cpu(), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_rms_norm_matches_torch_rms_norm(dtype):
    import torch_npu

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g).to(dtype)
    w = torch.randn(16, generator=g).to(dtype)
    xn, wn = x.to("npu").requires_grad_(), w.to("npu").requires_grad_()
    y, rstd = torch_npu.npu_rms_norm(xn, wn, epsilon=1e-5)
    assert y.device.type == "npu" and y.dtype == dtype and rstd.dtype == torch.float32
    assert rstd.shape == (3, 5, 1)
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    ref = F.rms_norm(xr, (16,), wr, eps=1e-5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    _close(y.float(), ref, **tol)
    _close(rstd.squeeze(-1), 1 / x.float().pow(2).mean(-1).add(1e-5).sqrt(), atol=1e-5, rtol=1e-5)
    y.float().square().sum().backward()
    ref.square().sum().backward()
    _close(xn.grad.float(), xr.grad, **tol)
    _close(wn.grad.float(), wr.grad, **(tol if dtype == torch.float32 else dict(atol=0.5, rtol=5e-2)))
    with pytest.raises(ValueError, match="trailing dimensions"):
        torch_npu.npu_rms_norm(xn, torch.ones(8, device="npu"))


def test_npu_swiglu_matches_silu_gate():
    import torch_npu

    x = torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(1))
    for dim in (-1, 1):
        a, b = torch.split(x, x.shape[dim] // 2, dim=dim)
        ref = a * torch.sigmoid(a) * b
        out = torch_npu.npu_swiglu(x.to("npu"), dim=dim)
        assert out.device.type == "npu"
        _close(out, ref)
    with pytest.raises(ValueError, match="even"):
        torch_npu.npu_swiglu(torch.ones(2, 3, device="npu"))


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_npu_rotary_mul_is_a_rotation_by_the_given_angles(mode):
    import torch_npu

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    theta = torch.rand(1, 1, 4, 4, generator=g, dtype=torch.float64) * 6.28
    # reference: pairs (x_a, x_b) as complex numbers multiplied by e^{i theta}
    if mode == "half":
        pairs = torch.complex(x[..., :4], x[..., 4:])
        r1 = torch.cat([theta.cos(), theta.cos()], -1)
        r2 = torch.cat([theta.sin(), theta.sin()], -1)
    else:
        pairs = torch.complex(x[..., 0::2], x[..., 1::2])
        r1 = theta.cos().repeat_interleave(2, -1)
        r2 = theta.sin().repeat_interleave(2, -1)
    rot = pairs * torch.polar(torch.ones_like(theta), theta)
    ref = torch.cat([rot.real, rot.imag], -1) if mode == "half" else torch.stack([rot.real, rot.imag], -1).flatten(-2)
    out = torch_npu.npu_rotary_mul(x.to("npu"), r1.to("npu"), r2.to("npu"), rotary_mode=mode)
    _close(out, ref)
    with pytest.raises(ValueError, match="rotary_mode"):
        torch_npu.npu_rotary_mul(x.to("npu"), r1.to("npu"), r2.to("npu"), rotary_mode="diagonal")


def test_npu_cross_entropy_loss_matches_log_softmax_gather():
    import torch_npu

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 11, generator=g)
    target = torch.randint(0, 11, (7,), generator=g)
    target[2] = -100
    loss, log_prob, zloss, lse = torch_npu.npu_cross_entropy_loss(logits.to("npu"), target.to("npu"),
                                                                  reduction="none")
    ref_lp = logits - logits.logsumexp(-1, keepdim=True)
    ref_loss = -ref_lp.gather(-1, target.clamp(min=0)[:, None])[:, 0] * (target != -100)
    _close(log_prob, ref_lp, atol=1e-6, rtol=1e-6)
    _close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert zloss.numel() == 0 and lse.numel() == 0
    mean, *_ = torch_npu.npu_cross_entropy_loss(logits.to("npu"), target.to("npu"))
    _close(mean, ref_loss.sum() / (target != -100).sum(), atol=1e-6, rtol=1e-6)
    with pytest.raises(NotImplementedError, match="z-loss"):
        torch_npu.npu_cross_entropy_loss(logits.to("npu"), target.to("npu"), return_zloss=True)


def _sdpa_reference(q, k, v, scale, keep):
    """torch's scaled_dot_product_attention on (B, N, S, D) with ``keep`` (True = attend)."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, scale=scale,
                                          enable_gqa=True).float()


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
@pytest.mark.parametrize("sparse_mode", [0, 2, 3])
def test_npu_fusion_attention_matches_sdpa(layout, sparse_mode):
    import torch_npu

    g = torch.Generator().manual_seed(4)
    b, n, nkv, sq, skv, d = 2, 4, 2, 5, 7, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h, s in ((n, sq), (nkv, skv), (nkv, skv)))
    masked = torch.rand(b, 1, sq, skv, generator=g) < 0.3
    masked[..., 0] = False  # every row keeps one key
    if sparse_mode == 0:
        keep, mask = ~masked, masked
    else:
        offset = 1 if sparse_mode == 2 else skv - sq + 1
        keep = ~torch.ones(sq, skv, dtype=torch.bool).triu(offset)
        mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)  # what transformers passes
    ref = _sdpa_reference(q, k, v, 0.3, keep)

    def to_layout(t):
        if layout == "BSND":
            return t.transpose(1, 2)
        if layout == "BSH":
            return t.transpose(1, 2).flatten(2)
        if layout == "SBH":
            return t.permute(2, 0, 1, 3).flatten(2)
        return t

    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(
        to_layout(q).to("npu"), to_layout(k).to("npu"), to_layout(v).to("npu"), n, layout,
        atten_mask=mask.to("npu"), scale=0.3, sparse_mode=sparse_mode)
    assert out.device.type == "npu" and smax.shape == (b, n, sq, 8) and ssum.shape == (b, n, sq, 8)
    _close(out, to_layout(ref), atol=1e-5, rtol=1e-5)


def test_npu_fusion_attention_packed_sequences():
    import torch_npu

    g = torch.Generator().manual_seed(5)
    lens, n, d = [3, 5], 2, 4
    q, k, v = (torch.randn(sum(lens), n, d, generator=g) for _ in range(3))
    out = torch_npu.npu_fusion_attention(q.to("npu"), k.to("npu"), v.to("npu"), n, "TND", scale=0.5,
                                         atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1).to("npu"),
                                         actual_seq_qlen=(3, 8), actual_seq_kvlen=(3, 8), sparse_mode=3)[0]
    start = 0
    for length in lens:
        sl = slice(start, start + length)
        ref = _sdpa_reference(*(t[sl].transpose(0, 1)[None] for t in (q, k, v)), 0.5,
                              torch.ones(length, length, dtype=torch.bool).tril())
        _close(out[sl], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        start += length
    with pytest.raises(NotImplementedError, match="dropout"):
        torch_npu.npu_fusion_attention(q.to("npu"), k.to("npu"), v.to("npu"), n, "TND", keep_prob=0.9,
                                       actual_seq_qlen=(8,), actual_seq_kvlen=(8,))
