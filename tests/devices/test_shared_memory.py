"""Shared-memory segments as host tensors: a reader's pages dropped after reading, data kept, nothing left."""

import mmap
import os
import pathlib

import pytest
import torch

import hal
from devices.shared_memory import SharedSegment, attach, drop_mapped_pages, segment_path

MIB = 1 << 20


def rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_a_reader_drops_the_pages_it_read_and_reads_the_same_bytes_again():
    segment = SharedSegment(16 * MIB, "hal-test-")
    try:
        segment.tensor.copy_(torch.arange(16 * MIB, dtype=torch.int64).to(torch.uint8))
        reader = attach(segment.name, 16 * MIB)
        before = rss_bytes()
        first = int(reader.sum(dtype=torch.int64))  # maps every page of the reader's mapping
        mapped = rss_bytes()
        assert mapped - before > 12 * MIB
        assert drop_mapped_pages(reader, 0, 16 * MIB)
        assert mapped - rss_bytes() > 12 * MIB  # the reader's pages are gone from its resident memory
        assert int(reader.sum(dtype=torch.int64)) == first  # nothing lost: the segment still holds them
        assert torch.equal(reader, segment.tensor)
        assert drop_mapped_pages(reader, 5, 1)  # a range inside one page: that page, widened to whole pages
        assert int(reader[5]) == 5
    finally:
        segment.unlink()
    assert not os.path.exists(segment_path(segment.name))


@pytest.mark.parametrize("start, nbytes", [(-1, 10), (0, 4 * MIB + 1), (4 * MIB, 1), (0, -5)])
def test_a_range_outside_the_mapping_is_refused_naming_it(start, nbytes):
    segment = SharedSegment(4 * MIB, "hal-test-")
    try:
        with pytest.raises(ValueError, match=rf"cannot drop bytes \[{start}, {start + nbytes}\) of a mapping of "
                                             rf"{4 * MIB} bytes"):
            drop_mapped_pages(segment.tensor, start, nbytes)
    finally:
        segment.unlink()


def test_a_tensor_that_is_not_a_whole_mapping_is_refused():
    segment = SharedSegment(4 * MIB, "hal-test-")
    try:
        with pytest.raises(ValueError, match="page-aligned mapped segment"):
            drop_mapped_pages(segment.tensor[mmap.PAGESIZE // 2:], 0, 10)  # it would drop its neighbour's page
    finally:
        segment.unlink()


def test_device_memory_is_dropped_only_where_the_kind_keeps_it_in_host_memory():
    from devices.npu_sim import ipc

    segment = SharedSegment(MIB, "hal-test-")
    hal.resolve_device("npu-sim").torch_module()
    shared = ipc.share_buffer(MIB, torch.device("npu", 0))
    try:
        assert hal.resolve_device("cpu").drop_shared_pages(segment.tensor, 0, MIB)
        assert hal.resolve_device("npu-sim").drop_shared_pages(segment.tensor, 0, MIB)
        assert int(segment.tensor.sum()) == 0
        # a device tensor: the default (a real device's memory is not this process's pages) leaves it alone
        assert not hal.resolve_device("cpu").drop_shared_pages(shared.tensor, 0, MIB)
        assert hal.resolve_device("npu-sim").drop_shared_pages(shared.tensor, 0, MIB)  # the sim's is host memory
    finally:
        segment.unlink()
        shared.release()


_FULL_SHM = """
import errno, os
from devices.shared_memory import SharedSegment
try:
    SharedSegment(8 << 20, prefix="hal-full-")
except OSError as exc:
    print("refused", errno.errorcode[exc.errno], exc)
print("left", sorted(os.listdir("/dev/shm")))
"""


def test_a_segment_larger_than_what_dev_shm_has_left_is_an_oserror_not_a_sigbus():
    """The soak's full_shm fault (issue 32): on a 4 MiB tmpfs an 8 MiB segment used to kill its creator with
    SIGBUS at the first touch; now it is refused with ENOSPC and leaves no segment behind."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount a small private /dev/shm")
    script = f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c '{_FULL_SHM}'"
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=120, cwd=pathlib.Path(__file__).resolve().parents[2])
    if out.returncode != 0 and "mount" in out.stderr and "refused" not in out.stdout:
        pytest.skip(f"cannot mount a private tmpfs here: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]  # -7 (SIGBUS) before the fix
    assert "refused ENOSPC [Errno 28] cannot reserve 8388608 bytes for shared segment /dev/shm/hal-full-" in out.stdout
    assert "left []" in out.stdout
