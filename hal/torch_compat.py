"""Accessors of torch's private names that trainer engines need (DTensor shards, FSDP2 state).

``engines`` and ``ckpt`` import them from here; each is :mod:`devices.torch_compat`'s.
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
