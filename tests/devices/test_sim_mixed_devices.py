"""The simulated npu refuses an operator whose tensors sit on two devices, in torch's words, as a device does.

Its memory is all host memory, so the cpu kernels it runs could compute across devices; real hardware cannot,
and a sim that let ``model(x)`` run with the model on npu:1 and ``x`` on npu:0 hid exactly the bug the npu
lane exists to catch. Copies between devices, and 0-dim cpu scalars joining a device operator, stay allowed.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hal

REPO = pathlib.Path(__file__).resolve().parents[2]
SAME = "Expected all tensors to be on the same device, but "

pytestmark = pytest.mark.skipif(not hal.availability("npu-sim"),
                                reason=f"npu-sim unavailable: {hal.availability('npu-sim').reason}")


@pytest.fixture
def npu():
    module = hal.get_torch_device("npu-sim")
    assert module.device_count() >= 2
    return module


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _wrapper_message(arg: str, got: str, common: str, method: str) -> str:
    """The device check of torch's generated wrappers (aten/src/ATen/core/adaption.cpp)."""
    return (f"{SAME}got {arg} is on {got}, different from other tensors on {common} "
            f"(when checking argument in method {method})")


def test_a_model_on_npu1_refuses_an_input_on_npu0(npu):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4).to("npu:1")
    x = torch.ones(2, 3, device="npu:0")
    # as torch on two cuda devices: F.linear is addmm(bias, x, weight.t()), the bias sets the device
    with pytest.raises(RuntimeError) as info:
        model(x)
    assert str(info.value).splitlines()[0] == _wrapper_message("mat1", "npu:0", "npu:1", "wrapper_out_addmm_out")
    with pytest.raises(RuntimeError) as info:
        F.linear(x, model.weight)  # no bias: mm(x, weight.t())
    assert str(info.value).splitlines()[0] == _wrapper_message("mat2", "npu:1", "npu:0", "wrapper_out_mm_out")
    # the same model on the input's own device computes, and computes what the host does
    out = model(x.to("npu:1"))
    assert out.device == torch.device("npu", 1)
    expected = F.linear(torch.ones(2, 3), model.weight.detach().cpu(), model.bias.detach().cpu())
    assert torch.equal(out.detach().cpu(), expected)


@pytest.mark.parametrize("op, message", [
    (lambda a, b: a + b, f"{SAME}found at least two devices, npu:0 and npu:1!"),
    (lambda a, b: a * b, f"{SAME}found at least two devices, npu:0 and npu:1!"),
    (lambda a, b: a.clone().mul_(b), f"{SAME}found at least two devices, npu:0 and npu:1!"),
    (lambda a, b: torch.where(a > 0, a, b), f"{SAME}found at least two devices, npu:0 and npu:1!"),
    (lambda a, b: a * b[0, 0], f"{SAME}found at least two devices, npu:0 and npu:1!"),  # a 0-dim npu tensor
    (lambda a, b: a @ b.t(), _wrapper_message("mat2", "npu:1", "npu:0", "wrapper_out_mm_out")),
    (lambda a, b: torch.matmul(a[None], b.t()[None]), _wrapper_message("mat2", "npu:1", "npu:0",
                                                                       "wrapper_out_bmm_out")),
    (lambda a, b: torch.cat([a, b]), _wrapper_message("tensors", "npu:1", "npu:0", "wrapper_out_cat_out")),
    (lambda a, b: torch.index_select(a, 0, b[:, 0].long()), _wrapper_message("index", "npu:1", "npu:0",
                                                                             "wrapper__index_select")),
    (lambda a, b: torch.mm(a, a.t(), out=b[:, :2].contiguous()), _wrapper_message("out", "npu:1", "npu:0",
                                                                                  "wrapper_out_mm_out")),
], ids=["add", "mul", "mul_", "where", "0-dim", "matmul", "bmm", "cat", "index_select", "mm-out"])
def test_every_kind_of_operator_refuses_two_device_indices(npu, op, message):
    a = torch.ones(2, 3, device="npu:0")
    b = torch.ones(2, 3, device="npu:1")
    with pytest.raises(RuntimeError) as info:
        op(a, b)
    assert str(info.value).splitlines()[0] == message


def test_the_copying_fallback_refuses_too(npu):
    code = ("import torch, hal\n"
            "m = torch.nn.Linear(3, 4).to('npu:1')\n"
            "try:\n    m(torch.ones(2, 3, device='npu:0'))\nexcept RuntimeError as e:\n"
            "    print('REFUSED', str(e).splitlines()[0])\n"
            "print('SAME', m(torch.ones(2, 3, device='npu:1')).device)\n")
    env = {**os.environ, "HAL_DEVICE": "npu-sim", "HAL_SIM_COPY_FALLBACK": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"REFUSED {_wrapper_message('mat1', 'npu:0', 'npu:1', 'wrapper_out_addmm_out')}" in out.stdout
    assert "SAME npu:1" in out.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_copies_across_indices_still_work_byte_exact(npu, dtype):
    g = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (4, 5, 8), dtype=torch.uint8, generator=g).view(-1).view(dtype).reshape(4, 5, -1)
    on0 = host.to("npu:0")
    on1 = on0.to("npu:1")
    assert on1.device == torch.device("npu", 1) and _bytes(on1) == _bytes(host)
    into = torch.empty_like(host, device="npu:1")
    into.copy_(on0.transpose(0, 1).transpose(0, 1), non_blocking=True)
    assert _bytes(into) == _bytes(host)
    strided = on1[:, ::2]
    back = torch.empty_like(strided, device="npu:0")
    back.copy_(strided)
    assert back.device == torch.device("npu", 0) and _bytes(back) == _bytes(host[:, ::2])
    assert _bytes(on1.to("npu:0").to("cpu")) == _bytes(host)


def test_a_cpu_scalar_joins_an_operator_on_any_index(npu):
    x = torch.arange(6, dtype=torch.float32, device="npu:1").reshape(2, 3)
    scaled = x * torch.tensor(2.0)
    assert scaled.device == torch.device("npu", 1)
    assert scaled.cpu().tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    picked = torch.where(x > 2, x, torch.tensor(-1.0))
    assert picked.device == torch.device("npu", 1) and picked.cpu().tolist() == [[-1.0, -1.0, -1.0],
                                                                                  [3.0, 4.0, 5.0]]
    rows = x[torch.tensor([1, 0])]  # cpu indices, as torch takes them for a device tensor
    assert rows.device == torch.device("npu", 1) and rows.cpu().tolist() == [[3.0, 4.0, 5.0], [0.0, 1.0, 2.0]]


def test_a_result_grown_by_the_cpu_kernel_stays_on_its_device(npu):
    # an out= tensor the kernel resizes (arange's, mm's) gets its new block on its own device, not the current
    # one: it was counted on npu:0, and its views (reshape) said npu:0 while the tensor said npu:1
    assert npu.current_device() == 0
    before = [npu.memory_allocated(0), npu.memory_allocated(1)]
    x = torch.arange(1 << 20, dtype=torch.float32, device="npu:1")
    assert [npu.memory_allocated(0) - before[0], npu.memory_allocated(1) - before[1]] == [0, 4 << 20]
    assert x.untyped_storage().device == x.reshape(2, -1).device == torch.device("npu", 1)
    out = torch.empty(0, device="npu:1")
    torch.mm(torch.ones(2, 3, device="npu:1"), torch.ones(3, 2, device="npu:1"), out=out)
    assert out.view(-1).device == torch.device("npu", 1) and out.cpu().tolist() == [[3.0, 3.0], [3.0, 3.0]]
    grown = torch.empty(0, device="npu:1")
    torch.add(torch.ones(4, device="npu:1"), 1, out=grown)
    assert grown.untyped_storage().device == torch.device("npu", 1) and grown.cpu().tolist() == [2.0] * 4


def test_training_on_a_device_that_is_not_current_is_unaffected(npu):
    assert npu.current_device() == 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    model.to("npu:1")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    batch = torch.randn(5, 4)
    for m, o, x in ((model, opt, batch.to("npu:1")), (reference, ref_opt, batch)):
        m(x).square().mean().backward()
        o.step()
    assert {p.device for p in model.parameters()} == {torch.device("npu", 1)}
    diff = max((p.detach().cpu() - r.detach()).abs().max().item()
               for p, r in zip(model.parameters(), reference.parameters()))
    assert diff < 1e-6, diff
    assert re.fullmatch(r"npu:1", str(next(iter(opt.state.values()))["exp_avg"].device))
