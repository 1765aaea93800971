"""hal.apps.soak.strike: the soak host's own calls are the driver's four; the others go to the worker."""

import asyncio

import pytest

from ckpt.manager import ManagedWorker
from hal.apps.soak.faults import Fault
from hal.apps.soak.strike import Host
from hal.apps.weightsync.worker import Worker


class FakeRollout(ManagedWorker):
    index = 1

    async def update_weights(self, global_steps):
        raise ValueError(f"step {global_steps} refused")


def test_the_driver_arms_and_disarms_through_the_host_and_updates_reach_the_worker():
    host = Host(FakeRollout(), print, in_process=True)
    fault = Fault(update=2, kind="flip", target=1, moment="mid_bucket", fraction=0.5)
    asyncio.run(host.invoke(Host.arm, fault))
    assert host.armed == fault
    assert asyncio.run(host.invoke(Host.disarm)) is True and host.armed is None
    with pytest.raises(ValueError, match="^step 3 refused$"):
        asyncio.run(host.invoke(ManagedWorker.update_weights, 3))
    assert host.reported["update"] == 3 and host.reported["raised"] is True  # recorded around the worker's call


@pytest.mark.parametrize("method", [Host.strike, Host.record_bytes, Host.invoke])
def test_a_host_method_the_driver_does_not_call_is_refused(method):
    host = Host(FakeRollout(), print, in_process=True)
    with pytest.raises(AttributeError, match=r"^the soak host's calls are \['Host\.arm', 'Host\.disarm', "
                                             rf"'Host\.observe', 'Host\.resources'\], got Host\.{method.__name__}$"):
        asyncio.run(host.invoke(method, Fault(update=1, kind="kill", target=1, moment="before_send")))


def test_a_method_of_neither_the_host_nor_the_worker_is_named():
    host = Host(FakeRollout(), print, in_process=True)
    with pytest.raises(AttributeError, match=r"^Worker\.where: none of \['FakeRollout'\] is a Worker$"):
        asyncio.run(host.invoke(Worker.where))
