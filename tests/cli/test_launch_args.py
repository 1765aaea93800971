"""hal launch's translation to torch.distributed.run arguments and per-process environment."""

import pytest

import hal
from hal.apps.errors import UsageError
from hal.apps.cli.launch import Launch, launch_env, torchrun_argv


def test_single_node_is_standalone():
    argv = torchrun_argv(Launch(device="cpu", nproc_per_node=4, script=("train.py", "--lr", "1")))
    assert argv == ["--nproc-per-node=4", "--nnodes=1", "--max-restarts=0", "--standalone", "train.py", "--lr", "1"]


def test_multi_node_uses_the_rendezvous_endpoint():
    argv = torchrun_argv(Launch(nproc_per_node=8, nnodes="2", node_rank=1, rdzv_endpoint="10.0.0.1:29400",
                                script=("t.py",)))
    assert "--rdzv-endpoint=10.0.0.1:29400" in argv and "--node-rank=1" in argv and "--standalone" not in argv


def test_environment_carries_the_kind_and_its_visible_devices(monkeypatch):
    assert launch_env(Launch(device="cpu", nproc_per_node=2)) == {"HAL_DEVICE": "cpu"}

    @__import__("dataclasses").dataclass(frozen=True)
    class Gpuish(hal.registry.get_spec("cpu").__class__):
        kind: str = "gpuish"
        visible_devices_env: str | None = "GPUISH_VISIBLE_DEVICES"

    hal.register_device(Gpuish())
    try:
        hal.reset()
        monkeypatch.delenv("GPUISH_VISIBLE_DEVICES", raising=False)
        assert launch_env(Launch(device="gpuish", nproc_per_node=3)) == \
            {"HAL_DEVICE": "gpuish", "GPUISH_VISIBLE_DEVICES": "0,1,2"}
        monkeypatch.setenv("GPUISH_VISIBLE_DEVICES", "4,5")
        assert launch_env(Launch(device="gpuish"))["GPUISH_VISIBLE_DEVICES"] == "4,5"
        assert launch_env(Launch(device="gpuish", visible_devices="7"))["GPUISH_VISIBLE_DEVICES"] == "7"
    finally:
        hal.unregister_device("gpuish")
        hal.reset()


def test_bad_launch_arguments_raise():
    with pytest.raises(ValueError, match="needs a script"):
        torchrun_argv(Launch())
    with pytest.raises(ValueError, match="-1"):
        torchrun_argv(Launch(nproc_per_node=-1, script=("x.py",)))
    for nnodes in ("0", "-1", "3:2", "0:2", "two", "1:x"):
        with pytest.raises(UsageError, match=f"--nnodes.*{nnodes!r}"):
            torchrun_argv(Launch(nnodes=nnodes, rdzv_endpoint="h:1", script=("x.py",)))
    for nnodes in ("2", "1:2"):  # more than one node: a standalone rendezvous no other node can join
        with pytest.raises(UsageError, match=f"--nnodes {nnodes} needs --rdzv-endpoint"):
            torchrun_argv(Launch(nnodes=nnodes, script=("x.py",)))
    assert "--nnodes=1:2" in torchrun_argv(Launch(nnodes="1:2", rdzv_endpoint="h:1", script=("x.py",)))
    assert "--standalone" in torchrun_argv(Launch(nnodes="1:1", script=("x.py",)))


def test_a_bad_node_count_fails_before_anything_starts(monkeypatch, capsys):
    from hal.apps.cli import launch
    from hal.apps.cli import main as m

    monkeypatch.setattr(launch, "launch_env", lambda args: pytest.fail("resolved devices for a bad --nnodes"))
    assert m.main(["launch", "--nnodes", "2", "--", "x.py"]) == 2
    assert m.main(["launch", "--nnodes", "0", "--rdzv-endpoint", "h:1", "--", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "--nnodes 2 needs --rdzv-endpoint" in err and "--nnodes '0'" in err and "Traceback" not in err


def test_more_processes_than_visible_devices_are_refused(monkeypatch):
    hal.reset()

    @__import__("dataclasses").dataclass(frozen=True)
    class TwoDevices(hal.registry.get_spec("cpu").__class__):
        kind: str = "twodev"
        host_memory: bool = False
        visible_devices_env: str | None = "TWODEV_VISIBLE_DEVICES"

        def availability(self):
            return __import__("devices.base", fromlist=["Availability"]).Availability.available(2)

    hal.register_device(TwoDevices())
    try:
        monkeypatch.setenv("TWODEV_VISIBLE_DEVICES", "3")
        with pytest.raises(hal.DeviceIndexError) as info:
            launch_env(Launch(device="twodev", nproc_per_node=2))
        assert "--nproc-per-node 2" in str(info.value) and "1 device(s)" in str(info.value)
        assert "TWODEV_VISIBLE_DEVICES='3'" in str(info.value)
        with pytest.raises(hal.DeviceIndexError, match=r"--visible-devices='5'|TWODEV_VISIBLE_DEVICES='5'"):
            launch_env(Launch(device="twodev", nproc_per_node=2, visible_devices="5"))
        assert launch_env(Launch(device="twodev", nproc_per_node=2, visible_devices="5,6"))["TWODEV_VISIBLE_DEVICES"] \
            == "5,6"
        monkeypatch.delenv("TWODEV_VISIBLE_DEVICES")
        assert launch_env(Launch(device="twodev", nproc_per_node=2))["TWODEV_VISIBLE_DEVICES"] == "0,1"
        with pytest.raises(hal.DeviceIndexError, match=r"TWODEV_VISIBLE_DEVICES unset, .*reports 2 device"):
            launch_env(Launch(device="twodev", nproc_per_node=3))
    finally:
        hal.unregister_device("twodev")
        hal.reset()


def test_an_index_in_the_launch_device_is_refused(monkeypatch):
    with pytest.raises(hal.DeviceIndexError, match="binds each process to the device of its LOCAL_RANK"):
        launch_env(Launch(device="cpu:0", nproc_per_node=1))
    monkeypatch.setenv("HAL_DEVICE", "cpu:0")
    with pytest.raises(hal.DeviceIndexError, match="HAL_DEVICE='cpu:0'"):
        launch_env(Launch(nproc_per_node=1))
