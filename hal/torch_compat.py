"""The accessors of torch's private names that trainer engines need (DTensor local shards, FSDP2's
per-parameter state), as hal's API: ``engines`` and ``ckpt`` import them from here, never from ``devices``.

Each is :mod:`devices.torch_compat`'s, which holds every private torch name the project touches in one file
(see its docstring and ``tests/devices/test_torch_compat.py``).
"""

from devices.torch_compat import (
    dtensor_local,
    fsdp_param_name,
    fsdp_params,
    fsdp_sharded_data,
    fsdp_sharded_param,
    set_dtensor_local,
    set_fsdp_sharded_data,
)

__all__ = ["dtensor_local", "set_dtensor_local", "fsdp_params", "fsdp_param_name", "fsdp_sharded_param",
           "fsdp_sharded_data", "set_fsdp_sharded_data"]
