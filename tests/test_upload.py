"""memra.upload: the same values on the device and back, and on CUDA copies that do not wait for the
whole stream."""

import pytest
import torch

from cuda_marks import DEVICES, cuda_only
from memra.upload import start_download, upload, upload_parts, upload_values


@pytest.mark.parametrize("device", DEVICES)
def test_upload_gives_the_same_values(device):
    values = [0, 7, -3, 2**40, 5]
    got = upload_values(values, torch.int64, device)
    assert got.device.type == device and got.dtype == torch.int64
    assert torch.equal(got.cpu(), torch.tensor(values, dtype=torch.int64))
    host = torch.randn(3, 5, dtype=torch.float32)
    assert torch.equal(upload(host, device).cpu(), host)
    flags = upload_values([True, False, True], torch.uint8, device)
    assert flags.tolist() == [1, 0, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_upload_parts_start_every_part_on_16_bytes(device, dtype):
    """Each part keeps its values and starts 16-byte aligned whatever the lengths before it (Triton
    compiles per pointer alignment: a part's alignment must not change with a step's piece count)."""
    for lengths in ((5, 3), (1, 1, 1), (4, 0, 7), (10, 2, 9)):
        parts = [[100 * i + j for j in range(n)] for i, n in enumerate(lengths)]
        got = upload_parts(parts, dtype, device)
        for part, view in zip(parts, got):
            assert view.dtype == dtype and view.tolist() == part
            assert view.data_ptr() % 16 == 0


@cuda_only
def test_upload_queues_behind_running_work_without_waiting():
    """With ~0.2 s of GPU work queued, upload returns while that work still runs, and what reads the
    uploaded tensor later on the stream sees its values (stream order). A plain .to("cuda") from
    pageable memory would have waited for the queue to drain."""
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(400_000_000)  # a long kernel (~0.2 s on current GPUs)
    busy.record()
    got = upload_values(list(range(1000)), torch.int64, "cuda")
    still_running = not busy.query()
    total = got.sum()  # queued after the copy
    assert still_running, "upload waited for the work queued before it"
    assert int(total) == sum(range(1000))


@pytest.mark.parametrize("device", DEVICES)
def test_download_gives_the_same_values(device):
    t = torch.tensor([3, -1, 2**40], dtype=torch.int64, device=device)
    copy = start_download(t)
    t += 1  # later work on t: the copy holds the values as they were when it was queued
    assert copy.wait() == [3, -1, 2**40]
    assert start_download(torch.tensor([0.5, -2.0], dtype=torch.float64, device=device)).wait() == [0.5, -2.0]


@cuda_only
def test_download_waits_for_its_copy_not_for_later_work():
    """A download queued before ~0.2 s of GPU work is read while that work still runs: the engine reads
    step N's tokens while step N+1 runs. t.tolist() would have waited for the whole stream."""
    t = torch.arange(10, device="cuda")
    copy = start_download(t)
    busy = torch.cuda.Event()
    torch.cuda._sleep(400_000_000)  # queued after the copy
    busy.record()
    assert copy.wait() == list(range(10))
    assert not busy.query(), "the download waited for work queued after it"
