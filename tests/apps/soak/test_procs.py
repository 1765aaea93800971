"""hal.apps.soak.procs: what the soak's worker processes run with."""

import json
import os
import subprocess
import sys
import textwrap

from hal.apps.soak.procs import WORKER_ENV_DEFAULTS

# One gloo process: fill what a warm-up fills, then the growth of its anonymous memory over 1000 more collectives.
_GROWTH = textwrap.dedent("""
    import ctypes, gc, json, sys
    import torch, torch.distributed as dist

    def held():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    t = torch.zeros(4)
    for _ in range(300):
        dist.broadcast(t, 0)
    before = held()
    for _ in range(1000):
        dist.broadcast(t, 0)
    print(json.dumps({"growth": held() - before}))
    dist.destroy_process_group()
""")


def _growth(env, rendezvous):
    out = subprocess.run([sys.executable, "-c", _GROWTH, str(rendezvous)], env=env, capture_output=True,
                         text=True, timeout=90, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def test_a_workers_flight_recorder_is_full_before_the_leak_rule_looks(tmp_path):
    # torch's flight recorder keeps 2000 collectives by default, about 0.8 KiB each: a worker's memory grew for
    # some 200 updates and the leak rule failed clean runs. With the soak's default, 1000 collectives after a
    # warm-up of 300 leave memory flat; without it (torch's default) the same run grows by the ring's filling.
    base = {k: v for k, v in os.environ.items() if k not in WORKER_ENV_DEFAULTS}
    soak = _growth({**WORKER_ENV_DEFAULTS, **base}, tmp_path / "soak")
    default = _growth(base, tmp_path / "default")
    assert soak < 128 * 1024, soak
    assert default > 512 * 1024, default  # what the default costs here: the reason for the setting
