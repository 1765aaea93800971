"""Run in a fresh process: what verl 0.9.1's ``verl.utils.device`` reports, imported before or after hal.

``python -m tests.interop.verl_device_probe verl-first|hal-first [verl-first|hal-first]`` prints
``RESULT <json>``; with a second order it also starts a ``multiprocessing`` spawn child that imports in that
order, and reports the child's answer under ``"child"``. Nothing here registers the sim: with ``HAL_DEVICE=npu-sim`` in the environment,
``import torch`` does (torch's backend autoload).
"""

from __future__ import annotations

import json
import multiprocessing
import sys


def report(order: str) -> dict:
    if order == "hal-first":
        import hal

        hal_kind = hal.resolve_device().kind
    import verl.utils.device as device

    if order == "verl-first":
        import hal

        hal_kind = hal.resolve_device().kind
    import torch

    return {"device": device.get_device_name(), "backend": device.get_nccl_backend(),
            "visible": device.get_visible_devices_keyword(), "npu": device.is_npu_available,
            "resource": device.get_resource_name(),
            "torch_device": device.get_torch_device() is getattr(torch, "npu", None),
            "hal": hal_kind, "hal_backend": hal.get_dist_backend()}


def _child(queue, order: str) -> None:
    queue.put(report(order))


if __name__ == "__main__":
    result = report(sys.argv[1])
    if sys.argv[2:]:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(queue, sys.argv[2]))
        proc.start()
        result["child"] = queue.get(timeout=300)
        proc.join(timeout=60)
    print("RESULT " + json.dumps(result), flush=True)
