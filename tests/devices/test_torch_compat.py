"""Each accessor of :mod:`devices.torch_compat` against the installed torch.

Run on torch 2.13.0 (CPU build; the NCCL options accessor needs a CUDA build and is skipped on a CPU
one); torch 2.14.0 (the Ascend lane's) was checked against its source, accessor by accessor, and the one
behaviour it adds (backends registered from an entry point on first use) has its own test here. When torch
is upgraded, run this file on the new release and add it to ``torch_compat.CHECKED_ON``:
:func:`test_running_torch_is_a_checked_release` fails until then. A further test keeps every private torch
name of ``hal``, ``engines``, ``ckpt`` and ``devices`` inside the compat module.
"""

from __future__ import annotations

import ast
import datetime
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import hal
from devices import torch_compat
from hal.apps.multiprocess import run_multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
TD = datetime.timedelta(seconds=30)


def test_running_torch_is_a_checked_release():
    release = torch.__version__.split("+")[0]
    assert release in torch_compat.CHECKED_ON, (
        f"torch {release} is not among the releases devices/torch_compat.py was checked on "
        f"{torch_compat.CHECKED_ON}: run tests/devices/test_torch_compat.py on it, then add it")


def test_every_accessor_has_a_test_here():
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    accessors = set(torch_compat.__all__) - {"CHECKED_ON", "BackendPlugin", "Work"}
    assert accessors <= tested, sorted(accessors - tested)
    assert "work_subclass" in tested


# -- DTensor and FSDP2: two ranks, a parameter whose shard needs padding ------------------------------

def _fsdp_worker(rank, world_size, kind):
    import gc

    hal.init_process_group(kind, timeout=30)
    out = _fsdp_checks(world_size, kind)
    # the mesh, DTensors and FSDP model (each holding the group) go before the group, not after, as DDP's Reducer
    # must (tests/engines/test_ddp_offload.py): rank 0 once ended with SIGABRT here when they outlived it. On an
    # error the group is left to the process's exit, for the same reason.
    gc.collect()
    dist.destroy_process_group()
    return out


def _fsdp_checks(world_size, kind):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    spec = hal.resolve_device(kind)
    device = hal.get_device(spec)
    mesh = init_device_mesh(spec.name, (world_size,))
    out = {}  # numpy arrays, not tensors: tensors would travel through shared memory that dies with the rank
    # a plain DTensor: rows 0-2 on rank 0, rows 3-4 on rank 1
    full = torch.arange(10.0).reshape(5, 2)
    dt = distribute_tensor(full.to(device), mesh, [Shard(0)], src_data_rank=None)  # no scatter: each slices
    local = torch_compat.dtensor_local(dt)
    out["dtensor_local"] = local.cpu().numpy()
    out["dtensor_local_is_to_local"] = local.data_ptr() == dt.to_local().data_ptr()
    replacement = local * 10
    wrapper = id(dt)
    torch_compat.set_dtensor_local(dt, replacement)
    out["set_dtensor_local"] = (id(dt) == wrapper, torch_compat.dtensor_local(dt) is replacement,
                                dt.full_tensor().cpu().numpy())
    # FSDP2: a 5x3 weight is sharded 3 + 2 rows, each shard padded to 3 rows
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1)).to(device)
    before = {n: p.detach().cpu().clone() for n, p in model.state_dict().items()}
    fully_shard(model, mesh=mesh)
    fps = list(torch_compat.fsdp_params(model))
    out["fsdp_params"] = len(fps)
    out["fsdp_param_name"] = [torch_compat.fsdp_param_name(fp) for fp in fps]
    params = list(model.parameters())
    out["fsdp_sharded_param"] = [torch_compat.fsdp_sharded_param(fp) is p for fp, p in zip(fps, params)]
    weight = fps[0]
    flat = torch_compat.fsdp_sharded_data(weight)
    shard = torch_compat.dtensor_local(torch_compat.fsdp_sharded_param(weight))
    out["fsdp_sharded_data"] = (flat.dim(), flat.numel(), shard.shape, shard.data_ptr() == flat.data_ptr(),
                                flat.device.type)
    new = (flat + 1).cpu().to(device)  # a new tensor, not a view of the old one
    torch_compat.set_fsdp_sharded_data(weight, new)
    shard = torch_compat.dtensor_local(torch_compat.fsdp_sharded_param(weight))
    out["set_fsdp_sharded_data"] = (torch_compat.fsdp_sharded_data(weight) is new,
                                    shard.data_ptr() == new.data_ptr(), tuple(shard.shape),
                                    params[0].full_tensor().detach().cpu().numpy(), before["0.weight"].numpy())
    return out


@pytest.fixture(scope="module", params=["cpu", "npu-sim"])
def fsdp(request):
    kind = request.param
    if not hal.registry.get_spec(kind).availability():
        pytest.skip(f"{kind} unavailable here")
    return run_multiprocess(_fsdp_worker, 2, kind, timeout=120)


def test_dtensor_local(fsdp):
    assert torch.equal(torch.from_numpy(fsdp[0]["dtensor_local"]), torch.arange(6.0).reshape(3, 2))
    assert torch.equal(torch.from_numpy(fsdp[1]["dtensor_local"]), torch.arange(6.0, 10.0).reshape(2, 2))
    assert fsdp[0]["dtensor_local_is_to_local"] and fsdp[1]["dtensor_local_is_to_local"]


def test_set_dtensor_local(fsdp):
    for rank in (0, 1):
        same_wrapper, stored, full = fsdp[rank]["set_dtensor_local"]
        assert same_wrapper and stored
        assert torch.equal(torch.from_numpy(full), torch.arange(10.0).reshape(5, 2) * 10)


def test_fsdp_params(fsdp):
    assert fsdp[0]["fsdp_params"] == fsdp[1]["fsdp_params"] == 4


def test_fsdp_param_name(fsdp):
    assert fsdp[0]["fsdp_param_name"] == ["weight", "bias", "weight", "bias"]  # relative to the owning module


def test_fsdp_sharded_param(fsdp):
    assert fsdp[0]["fsdp_sharded_param"] == [True] * 4


def test_fsdp_sharded_data(fsdp):
    # 5 rows over 2 ranks: 3 + 2, each padded to 3 rows of 3 -> a flat tensor of 9 elements per rank
    assert fsdp[0]["fsdp_sharded_data"][:4] == (1, 9, torch.Size([3, 3]), True)
    assert fsdp[1]["fsdp_sharded_data"][:4] == (1, 9, torch.Size([2, 3]), True)


def test_set_fsdp_sharded_data(fsdp):
    for rank, rows in ((0, 3), (1, 2)):
        is_new, views_new, shape, full, before = fsdp[rank]["set_fsdp_sharded_data"]
        assert is_new and views_new and shape == (rows, 3)
        assert torch.equal(torch.from_numpy(full), torch.from_numpy(before) + 1)  # the padding was dropped, every row moved


# -- c10d ------------------------------------------------------------------------------------------------

def _sim():
    if not hal.registry.get_spec("npu-sim").availability():
        pytest.skip("npu-sim unavailable here")
    hal.get_torch_device("npu-sim")


def test_registered_backend_plugins():
    _sim()
    assert "HCCL" in torch_compat.registered_backend_plugins()


def test_backend_plugin():
    _sim()
    from devices.npu_sim import backend as sim_backend

    plugin = torch_compat.backend_plugin("hccl")
    assert plugin == torch_compat.BackendPlugin(sim_backend.create, True)
    assert torch_compat.backend_plugin("HCCL") == plugin
    assert torch_compat.backend_plugin("no-such-backend") is None


def test_backend_plugin_asks_torch_to_load_an_entry_point_backend(monkeypatch):
    # torch 2.14 registers a backend offered through the torch.distributed.backends entry-point group only
    # when Backend._ensure_backend_registered(name) is called; an accessor that read Backend._plugins alone
    # would not see it. Stand in for the entry point (absent before 2.14: then the accessor must not need it).
    asked = []

    def creator(opts, backend_options):
        return None

    def ensure(name):
        asked.append(name)
        if name.lower() == "halcompat-ep":
            monkeypatch.setitem(dist.Backend._plugins, "HALCOMPAT-EP", dist.Backend._BackendPlugin(creator, True))

    monkeypatch.setattr(dist.Backend, "_ensure_backend_registered", ensure, raising=False)
    assert torch_compat.backend_plugin("halcompat-ep") == torch_compat.BackendPlugin(creator, True)
    assert torch_compat.backend_plugin("no-such-backend") is None
    assert asked == ["halcompat-ep", "no-such-backend"]


def test_extended_backend_options():
    _sim()
    store = dist.HashStore()
    opts = torch_compat.extended_backend_options(store, 0, 1, TD, "compat")
    assert (opts.group_rank, opts.group_size, opts.timeout, opts.group_id) == (0, 1, TD, "compat")
    assert opts.global_ranks_in_group == [0]
    group = torch_compat.backend_plugin("hccl").creator_fn(opts, None)  # the sim's hccl accepts them
    t = torch.ones(3, device="npu:0")
    group.allreduce([t]).wait()
    assert torch.equal(t.cpu(), torch.ones(3))
    group.shutdown()


@pytest.mark.skipif(not hasattr(dist, "ProcessGroupNCCL"), reason="this torch build has no NCCL (CPU build)")
def test_nccl_options():
    opts = torch_compat.nccl_options(TD)
    assert isinstance(opts, dist.ProcessGroupNCCL.Options)
    assert opts._timeout == TD


def test_work_subclass():
    class Done(torch_compat.Work):
        def wait(self, timeout=None):
            return True

    assert Done().wait() is True
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, TD)
    work = gloo.allreduce([torch.ones(2)])
    assert isinstance(work, torch_compat.Work) and work.wait()


def test_register_group_backend():
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, TD)

    class Group(dist.ProcessGroup):
        pass

    group = Group(0, 1)
    torch_compat.register_group_backend(group, torch.device("cpu"), gloo)
    assert group._get_backend(torch.device("cpu")) is gloo


# -- PrivateUse1 -----------------------------------------------------------------------------------------

def test_use_count():
    t = torch.ones(3)
    assert torch_compat.use_count(t) == 1  # Python's own reference
    view = t.view(3)  # a view keeps a C++ pointer to its base
    assert torch_compat.use_count(t) == 2
    del view
    assert torch_compat.use_count(t) == 1


def test_privateuse1_backend_name():
    _sim()
    assert torch_compat.privateuse1_backend_name() == "npu"
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}  # no sim autoload in the child
    fresh = subprocess.run([sys.executable, "-c", "from devices import torch_compat as c; "
                            "print(c.privateuse1_backend_name())"], capture_output=True, text=True, timeout=120,
                           env=env, cwd=ROOT)
    assert fresh.stdout.strip() == "privateuseone", fresh.stderr


def test_register_device_module():
    # a fresh interpreter: a device module's name must be a device type, so PrivateUse1 is renamed first.
    # No backend autoload there: where a real torch_npu is installed (the Ascend lane), `import torch` would
    # load it through torch's torch.backends entry point and it would take PrivateUse1 as 'npu' first.
    code = ("import types, torch; from devices import torch_compat as c; m = types.ModuleType('halcompat'); "
            "torch.utils.rename_privateuse1_backend('halcompat'); "
            "c.register_device_module('halcompat', m); print(torch.halcompat is m)\n"
            "try:\n    c.register_device_module('halcompat', m)\nexcept RuntimeError:\n    print('refused')")
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}  # no sim autoload in the child
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    assert done.stdout.split() == ["True", "refused"], done.stderr


# -- guard: private torch names appear only in the compat module -----------------------------------------

PACKAGES = ("hal", "engines", "ckpt", "devices")
ALLOWED = {("devices/npu_sim/strict.py", "_getframe"),  # CPython's sys._getframe, not torch
           ("hal/ray/placement.py", "_private"),  # Ray's worker lookup, not torch (see _assigned_ids there)
           ("ckpt/kimi_library.py", "_BACKEND_INSTANCE"),  # checkpoint-engine's, not torch (see its doc)
           ("ckpt/kimi_library.py", "_copy_to_buffer"),  # checkpoint-engine's ParameterServer, not torch
           ("hal/apps/shutdown.py", "_exit"),  # Python's documented os._exit (a rank's exit without cleanup), not torch
           # vLLM's LoRA manager, not torch: one manager loads an adapter from tensors (verl's VLLMHijack does it for all)
           ("ckpt/vllm_transfer.py", "_load_adapter")}


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_names(files: list[pathlib.Path], root: pathlib.Path = ROOT) -> list[tuple[str, int, str]]:
    """``(file, line, name)`` for each private attribute the project reads without defining it, each
    private attribute it writes on an object not its own (unless it publishes a function or class of its
    own under that name, as the sim's torch_npu API does), and each private name imported from torch."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    own, defs = set(), set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
                defs.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _root(node) in ("self", "cls"):
                own.add(node.attr)
    found = []
    for path, tree in trees.items():
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                store = isinstance(node.ctx, ast.Store)
                if _root(node) not in ("self", "cls") and (node.attr not in defs if store else node.attr not in own):
                    names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names = [n for n in [a.name for a in node.names] + node.module.split(".") if n.startswith("_")]
            elif isinstance(node, ast.Import):
                names = [n for a in node.names if a.name.split(".")[0] == "torch" for n in a.name.split(".")
                         if n.startswith("_")]
            found += [(rel, node.lineno, n) for n in names if not n.startswith("__") and (rel, n) not in ALLOWED]
    return found


def test_private_torch_names_only_in_the_compat_module():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    found = private_names(files)
    outside = [f"{f}:{line}: {name}" for f, line, name in found if f != "devices/torch_compat.py"]
    assert not outside, "private torch names outside devices/torch_compat.py:\n" + "\n".join(outside)
    inside = {name for f, _, name in found if f == "devices/torch_compat.py"}
    assert {"_local_tensor", "_sharded_param_data", "_get_fsdp_state", "_module_info", "_plugins",
            "_timeout", "_Work"} <= inside, inside


def test_the_guard_sees_reads_writes_and_imports(tmp_path):
    code = tmp_path / "x.py"
    code.write_text("from torch.distributed._tensor import DTensor\nfrom torch._C import _foo\n"
                    "def _published():\n    pass\nmodule._published = _published\n"
                    "class A:\n    def f(self, t, opts):\n        self._mine = 1\n        opts._timeout = 3\n"
                    "        return t._local_tensor, self._mine, dist.Backend._plugins\n")
    names = [n for _, _, n in private_names([code], tmp_path)]
    assert sorted(names) == sorted(["_tensor", "_C", "_foo", "_timeout", "_local_tensor", "_plugins"])
