"""Resolution order (explicit > HAL_DEVICE > auto), the errors users see, and plugin kinds."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hal
from devices.base import Availability, DeviceSpec
from hal import registry


@dataclasses.dataclass(frozen=True)
class FakeAccel(DeviceSpec):
    """A plugin kind whose availability the test controls."""

    kind: str = "fakeaccel"
    name: str = "cpu"  # its tensors are host tensors, so calls through it really run
    dist_backend: str = "gloo"
    visible_devices_env: str | None = "FAKE_VISIBLE_DEVICES"
    ray_resource: str | None = "FAKE"
    ok: bool = True

    def torch_module(self):
        return registry.get_spec("cpu").torch_module()

    def availability(self):
        return Availability.available(2) if self.ok else Availability.unavailable("fake driver not loaded")


@pytest.fixture
def plugin_kind():
    """Register FakeAccel for one test, then remove it and forget cached probes."""
    spec = hal.register_device(FakeAccel())
    hal.reset()
    yield spec
    hal.unregister_device(spec.kind)
    hal.reset()


def test_auto_on_this_machine_is_cpu_with_gloo():
    if torch.backends.cuda.is_built() and torch.cuda.is_available():
        pytest.skip("a GPU is present: auto resolves to cuda here")
    assert hal.resolve_device().kind == "cpu"
    assert hal.get_device_name() == "cpu"
    assert hal.get_dist_backend() == "gloo"
    assert hal.get_device() == torch.device("cpu")
    assert hal.get_visible_devices_keyword() is None


def test_auto_prefers_an_available_plugin_over_cpu(plugin_kind):
    assert hal.known_kinds()[-1] == "cpu"
    assert hal.known_kinds().index("fakeaccel") < hal.known_kinds().index("cpu")
    if hal.availability("npu") or hal.availability("cuda"):
        pytest.skip("a real accelerator outranks the plugin here")
    assert hal.resolve_device().kind == "fakeaccel"


def test_env_outranks_auto_and_explicit_outranks_env(plugin_kind, monkeypatch):
    monkeypatch.setenv("HAL_DEVICE", "cpu")
    assert hal.resolve_device().kind == "cpu"
    assert hal.resolve_device("fakeaccel").kind == "fakeaccel"
    assert hal.get_visible_devices_keyword("fakeaccel") == "FAKE_VISIBLE_DEVICES"
    monkeypatch.setenv("HAL_DEVICE", "FakeAccel")  # case-insensitive
    assert hal.resolve_device().kind == "fakeaccel"


def test_unknown_kind_lists_known_kinds(monkeypatch):
    with pytest.raises(hal.UnknownDeviceError) as info:
        hal.resolve_device("tpu")
    message = str(info.value)
    assert "'tpu'" in message
    for kind in ("npu", "cuda", "npu-sim", "cpu"):
        assert kind in message
    monkeypatch.setenv("HAL_DEVICE", "tpu")
    with pytest.raises(hal.UnknownDeviceError, match="tpu"):
        hal.get_dist_backend()
    assert isinstance(info.value, ValueError)


def test_unavailable_npu_names_reason_and_alternatives(monkeypatch):
    if hal.availability("npu"):
        pytest.skip("a real Ascend NPU is present")
    # as in a fresh process: no kind found available yet. Once an earlier test in this process has used
    # npu-sim, "npu" names the active sim (its tensors' device type), by design, and resolves to it.
    monkeypatch.setattr(hal.device, "_availability", {})
    monkeypatch.setenv("HAL_DEVICE", "npu")
    with pytest.raises(hal.DeviceUnavailableError) as info:
        hal.get_torch_device()
    message = str(info.value)
    assert "'npu' is unavailable" in message
    assert "torch_npu" in message  # the import error of torch_npu
    assert "available kinds:" in message and "cpu" in message


def test_unavailable_plugin_reason_is_reported():
    spec = hal.register_device(FakeAccel(kind="brokenaccel", ok=False))
    try:
        hal.reset()
        with pytest.raises(hal.DeviceUnavailableError, match="fake driver not loaded"):
            hal.resolve_device("brokenaccel")
        assert hal.resolve_device().kind != "brokenaccel"
    finally:
        hal.unregister_device(spec.kind)
        hal.reset()


def test_duplicate_registration_raises(plugin_kind):
    with pytest.raises(hal.DuplicateDeviceError, match="fakeaccel"):
        hal.register_device(FakeAccel())
    with pytest.raises(hal.DuplicateDeviceError, match="cuda"):
        hal.register_device(FakeAccel(kind="cuda"))
    with pytest.raises(TypeError, match="DeviceSpec"):
        hal.register_device("xpu")


def test_bad_device_arguments_raise_clearly():
    with pytest.raises(hal.UnknownDeviceError, match="integer index"):
        hal.resolve_device("cpu:first")
    with pytest.raises(hal.UnknownDeviceError, match="42"):
        hal.resolve_device(42)
    with pytest.raises(ValueError, match="1.5"):
        hal.manual_seed(1.5, "cpu")


def test_with_host_pair_for_accelerator_kinds(plugin_kind):
    assert hal.get_dist_backend("cpu", with_host=True) == "gloo"
    # For a device backend that is not gloo the pair keeps host objects on gloo.
    spec = hal.register_device(FakeAccel(kind="pairaccel", name="npu", dist_backend="hccl"))
    try:
        assert hal.get_dist_backend("pairaccel", with_host=True) == "cpu:gloo,npu:hccl"
    finally:
        hal.unregister_device(spec.kind)


def test_memory_stats_and_seed_on_cpu():
    stats = hal.memory_stats("cpu")
    assert set(stats) == {"allocated", "max_allocated", "reserved", "free", "total"}
    assert 0 < stats["free"] <= stats["total"]
    hal.manual_seed(7, "cpu")
    a = torch.rand(3)
    hal.manual_seed(7, "cpu")
    assert torch.equal(a, torch.rand(3))


PLUGIN_MODULE = textwrap.dedent('''
    import dataclasses
    from devices.base import Availability, DeviceSpec

    @dataclasses.dataclass(frozen=True)
    class Xpu(DeviceSpec):
        kind: str = "xpu-test"
        name: str = "cpu"
        dist_backend: str = "gloo"
        ray_resource: str | None = "XPU"
        def torch_module(self):
            import torch
            return torch.cpu
        def availability(self):
            return Availability.available(4)

    SPEC = Xpu()
''')


def test_entry_point_plugin_is_discovered(tmp_path, monkeypatch):
    # A third-party package as pip would install it: a module plus a dist-info with entry_points.txt.
    (tmp_path / "hal_xpu_plugin.py").write_text(PLUGIN_MODULE)
    info = tmp_path / "hal_xpu_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hal-xpu-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[hal.devices]\nxpu-test = hal_xpu_plugin:SPEC\nbroken-test = hal_xpu_plugin:MISSING\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        registry.reload_plugins()
        assert "xpu-test" in hal.known_kinds()
        assert hal.describe("xpu-test")["ray_resource"] == "XPU"
        assert hal.describe("xpu-test")["device_count"] == 4
        assert "broken-test" in hal.plugin_errors()  # a broken plugin is reported, not fatal
        with pytest.raises(hal.UnknownDeviceError, match="broken-test"):
            hal.resolve_device("nonexistent")
    finally:
        monkeypatch.undo()
        registry.reload_plugins()
        hal.reset()
    assert "xpu-test" not in hal.known_kinds()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=full_env)


def test_import_hal_probes_nothing_and_imports_no_vendor_package():
    out = _run("import sys, hal; print('torch_npu' in sys.modules, 'devices.npu' in sys.modules, "
               "'devices.npu_sim.ext' in sys.modules)")  # the sim's package top comes with torch's autoload
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]


def test_cpu_only_resolution_never_calls_torch_cuda():
    code = textwrap.dedent('''
        import torch
        if torch.backends.cuda.is_built():
            print("skip"); raise SystemExit
        import sys
        calls = []
        def spy(name):
            def call(*args, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if "/torch/" not in caller:  # torch.manual_seed itself seeds cuda lazily; that is torch's
                    calls.append((name, caller))
            return call
        for name in ("is_available", "device_count", "current_device", "set_device", "synchronize",
                     "empty_cache", "memory_allocated", "manual_seed_all", "mem_get_info"):
            setattr(torch.cuda, name, spy(name))
        import hal
        hal.resolve_device(); hal.get_device(); hal.get_dist_backend(); hal.memory_stats()
        hal.synchronize(); hal.empty_cache(); hal.manual_seed(0); hal.available_kinds()
        print(hal.get_device_name(), hal.get_dist_backend(), calls)
    ''')
    out = _run(code)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "skip":
        pytest.skip("torch is built with CUDA: the cuda probe legitimately asks torch.cuda")
    assert out.stdout.strip() == "cpu gloo []"


def test_hal_device_env_npu_fails_with_clear_error_in_a_fresh_process():
    code = textwrap.dedent('''
        import torch, hal
        try:
            hal.get_device()
        except hal.DeviceUnavailableError as exc:
            print("ERROR", exc)
            # the message lists cheap alternatives only: building the simulated npu is not a side effect
            print("sim registered:", hasattr(torch, "npu"))
        else:
            print("AVAILABLE")
    ''')
    out = _run(code, HAL_DEVICE="npu")
    assert out.returncode == 0, out.stderr
    if "AVAILABLE" in out.stdout:
        pytest.skip("a real Ascend NPU is present")
    assert "import torch_npu failed" in out.stdout and "available kinds: cpu" in out.stdout
    assert "sim registered: False" in out.stdout
