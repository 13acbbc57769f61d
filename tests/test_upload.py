"""memra.upload: the same values on the device, and on CUDA a copy that does not wait for the stream."""

import pytest
import torch

from cuda_marks import DEVICES, cuda_only
from memra.upload import upload, upload_values


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
