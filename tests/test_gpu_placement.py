"""Where the GPU path puts things, checked on a CPU by faking CUDA (issue 31):

- `place_rank` / `init_parallel`: NCCL on `cuda:local_rank` only with a GPU per rank of this machine; gloo on
  the CPU (with a log line) otherwise; a clear error when CUDA was asked for and cannot be had.
- `device_clock`, the pipeline timeline of `Worker.execute_parallel` and the TP all-reduce / all-gather timers
  synchronize the CUDA device before reading the clock (a stub records the order of the calls).
- `default_device()`: the parallel rank's device, then `MINFER_DEVICE`, then CUDA if visible.
- `attention_backend="auto"` resolves to "triton" on CUDA.
"""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest
import torch

import minfer.parallel.parallel_state as ps
import minfer.parallel.timeline as timeline
from minfer.attention import PagedReferenceBackend, PagedTorchBackend
from minfer.parallel.parallel_state import ParallelState, init_parallel, place_rank, set_parallel_state
from minfer.platform import default_device, get_platform


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend torch sees `n` GPUs; returns a setter. LOCAL_RANK / LOCAL_WORLD_SIZE are cleared."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


# -- rank placement ---------------------------------------------------------------------------------------------

def test_one_gpu_two_ranks_falls_back_to_gloo_on_the_cpu(fake_cuda, caplog):
    fake_cuda(1)
    with caplog.at_level(logging.WARNING, logger="minfer.parallel"):
        for rank in (0, 1):
            assert place_rank(2, rank) == ("gloo", torch.device("cpu"))
    assert "1 CUDA device(s) for 2 rank(s)" in caplog.text and "gloo on the CPU" in caplog.text


def test_a_gpu_per_rank_gives_nccl_on_the_local_device(fake_cuda):
    fake_cuda(4)
    assert place_rank(4, 3) == ("nccl", torch.device("cuda", 3))
    assert place_rank(2, 1) == ("nccl", torch.device("cuda", 1))
    assert place_rank(2, 1, device="cuda") == ("nccl", torch.device("cuda", 1))


def test_torchrun_local_rank_and_local_world(fake_cuda, monkeypatch):
    fake_cuda(2)
    # Two nodes of two ranks: global rank 3 is local rank 1 of its node, which has two GPUs: NCCL on cuda:1.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert place_rank(4, 3) == ("nccl", torch.device("cuda", 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # three ranks on a two-GPU node: the CPU
    assert place_rank(6, 1)[0] == "gloo"


def test_no_cuda_is_gloo_without_a_warning(fake_cuda, caplog):
    fake_cuda(0)
    with caplog.at_level(logging.WARNING, logger="minfer.parallel"):
        assert place_rank(3, 2) == ("gloo", torch.device("cpu"))
    assert caplog.text == ""


def test_device_cpu_is_gloo_even_with_gpus(fake_cuda):
    fake_cuda(8)
    assert place_rank(2, 0, device="cpu") == ("gloo", torch.device("cpu"))
    assert place_rank(2, 0, backend="gloo") == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize("kw", [dict(device="cuda"), dict(backend="nccl"), dict(device="cuda:0")])
def test_asking_for_cuda_without_a_gpu_per_rank_is_a_clear_error(fake_cuda, kw):
    fake_cuda(1)
    with pytest.raises(ValueError, match=r"one GPU per rank: 1 CUDA device\(s\) for 2 rank\(s\)"):
        place_rank(2, 1, **kw)
    fake_cuda(0)
    with pytest.raises(ValueError, match="no CUDA device"):
        place_rank(2, 0, **kw)


def test_contradictory_requests_and_bad_backend(fake_cuda):
    fake_cuda(2)
    with pytest.raises(ValueError, match="NCCL and CUDA go together"):
        place_rank(2, 0, backend="gloo", device="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        place_rank(2, 0, backend="mpi")


def test_init_parallel_refuses_before_joining(fake_cuda, monkeypatch):
    """The error comes before `init_process_group`, so no rank waits for one that gave up."""
    fake_cuda(1)
    joined = []
    monkeypatch.setattr(ps.dist, "init_process_group", lambda *a, **k: joined.append(a))
    with pytest.raises(ValueError, match="one GPU per rank"):
        init_parallel(2, 1, 0, "tcp://127.0.0.1:1", device="cuda")
    assert joined == []


def test_init_parallel_one_gpu_runs_the_job_on_gloo(fake_cuda, monkeypatch):
    """A job joined for real (one rank, gloo over loopback) whose rank has no GPU of its own (local rank 3,
    one fake GPU): the state says CPU and no CUDA device is set."""
    fake_cuda(1)
    set_device = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_device.append(d))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        st = init_parallel(1, 1, 0, f"tcp://127.0.0.1:{port}", local_rank=3)  # cuda:3 does not exist
        assert st.device == torch.device("cpu") and ps.dist.get_backend() == "gloo"
        assert set_device == []
    finally:
        ps.destroy_parallel()


# -- clocks that wait for the device -----------------------------------------------------------------------------

@pytest.fixture
def sync_log(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", str(device))))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return calls


def test_device_clock_synchronizes_cuda_only(sync_log, monkeypatch):
    timeline.device_clock("cpu")
    timeline.device_clock(None)
    assert sync_log == []
    timeline.device_clock(torch.device("cuda", 1))
    assert sync_log == [("sync", "cuda:1")]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # inside a graph capture
    timeline.device_clock("cuda")
    assert len(sync_log) == 1


class _FakeCudaTensor:
    """Enough of a tensor for the collectives' bookkeeping, on a fake CUDA device."""

    device = torch.device("cuda", 0)

    def numel(self):
        return 4

    def element_size(self):
        return 2

    def contiguous(self):
        return self


def test_all_reduce_and_all_gather_timers_synchronize(sync_log, monkeypatch):
    monkeypatch.setattr(ps.dist, "all_reduce", lambda x, group=None: sync_log.append(("all_reduce", None)))
    monkeypatch.setattr(ps.dist, "all_gather", lambda parts, x, group=None: sync_log.append(("all_gather", None)))
    monkeypatch.setattr(ps.torch, "empty_like", lambda x: torch.zeros(4))
    previous = set_parallel_state(ParallelState(tp_size=2, tp_rank=0))
    try:
        ps.tensor_model_parallel_all_reduce(_FakeCudaTensor())
        assert [c[0] for c in sync_log] == ["sync", "all_reduce", "sync"]
        sync_log.clear()
        ps.tensor_model_parallel_all_gather(_FakeCudaTensor(), dim=0)
        assert [c[0] for c in sync_log] == ["sync", "all_gather", "sync"]
        comm = ps.get_parallel_state().comm
        assert (comm.all_reduce_calls, comm.all_reduce_bytes, comm.all_gather_calls) == (1, 8, 1)
    finally:
        set_parallel_state(previous)


def test_pipeline_timeline_synchronizes_around_each_forward(sync_log):
    """`ParallelWorker.execute_parallel` on a stub worker whose device is CUDA: every recorded forward is bracketed by
    a synchronize (the Gantt chart's bars are execution, not launch)."""
    from minfer.parallel.timeline import TimelineRecorder
    from minfer.parallel.worker import ParallelWorker as Worker

    def model(ids, ctx, inter=None):
        sync_log.append(("forward", None))
        return torch.zeros(ids.numel(), 4)

    model.compute_logits = lambda h: torch.zeros(h.shape[0], 8)
    seqs = [SimpleNamespace(prompt_logprobs=None, spec_token_ids=[]) for _ in range(2)]
    stub = SimpleNamespace(
        parallel=ParallelState(), device=torch.device("cuda", 0), num_micro_batches=1, timeline=TimelineRecorder(),
        pool=SimpleNamespace(before_forward=lambda batch: None),
        prepare_inputs=lambda mb: (torch.zeros(2, dtype=torch.long),
                                   SimpleNamespace(logits_indices=torch.tensor([0, 1])), [0, 1]),
        model=model)
    batch = SimpleNamespace(seqs=seqs, num_new_tokens=[1, 1], swap_out=[], swap_in=[], copy=[])
    rows, logits, _ = Worker.execute_parallel(stub, batch, sample=False)
    assert rows == [0, 1] and logits.shape == (2, 8)
    assert [c[0] for c in sync_log] == ["sync", "forward", "sync"]
    (ev,) = stub.timeline.drain()
    assert ev["end"] >= ev["start"]


# -- the default device ------------------------------------------------------------------------------------------

def test_default_device(fake_cuda, monkeypatch):
    monkeypatch.delenv("MINFER_DEVICE", raising=False)
    fake_cuda(0)
    assert default_device() == torch.device("cpu")
    fake_cuda(1)
    assert default_device() == torch.device("cuda")
    monkeypatch.setenv("MINFER_DEVICE", "cpu")
    assert default_device() == torch.device("cpu")
    # A rank of a parallel job: the device init_parallel gave it, whatever else is visible or asked.
    previous = set_parallel_state(ParallelState(tp_size=2, device=torch.device("cuda", 1)))
    try:
        assert default_device() == torch.device("cuda", 1)
    finally:
        set_parallel_state(previous)
    monkeypatch.setenv("MINFER_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="not a device name"):
        default_device()
    fake_cuda(0)
    monkeypatch.setenv("MINFER_DEVICE", "cuda")
    with pytest.raises(ValueError, match="finds no CUDA device"):
        default_device()


# -- the attention backend "auto" picks ---------------------------------------------------------------------------

def backend_cls(name: str, device: torch.device, dtype: torch.dtype, kv: torch.dtype | None = None):
    """What the platform of `device` (kernels="auto") builds `attention_backend=name` with, for a model in
    `dtype` over a pool of `kv` (default: `dtype`)."""
    return get_platform("auto", device, dtype).get_attn_backend_cls(name, dtype, kv or dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_is_triton_on_cuda(dtype):
    from minfer.attention.triton import TritonBackend

    cuda = torch.device("cuda", 0)
    assert backend_cls("auto", cuda, dtype) is TritonBackend
    for kv in (torch.int8, torch.float8_e4m3fn):  # a quantized pool: the kernels dequantize on load
        assert backend_cls("auto", cuda, dtype, kv) is TritonBackend
    assert backend_cls("torch", cuda, dtype) is PagedReferenceBackend  # a named backend stays itself: the plain one


def test_auto_on_cuda_keeps_torch_for_a_cast_pool():
    """A 16-bit pool under a float32 model is what the Triton backend refuses: "auto" takes the reference."""
    assert backend_cls("auto", torch.device("cuda"), torch.float32, torch.bfloat16) is PagedTorchBackend


def test_auto_on_the_cpu_is_unchanged():
    assert backend_cls("auto", torch.device("cpu"), torch.float16) is PagedTorchBackend
