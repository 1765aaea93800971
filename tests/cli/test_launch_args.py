"""hal launch's translation to torch.distributed.run arguments and per-process environment."""

import pytest

import hal
from hal.cli.launch import Launch, launch_env, torchrun_argv


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
