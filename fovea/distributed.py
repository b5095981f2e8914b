"""Tensor-parallel process groups, and the group a layer is built for.

Every rank of a tensor-parallel engine joins four torch.distributed groups (the same processes each time):
  lm             tensors of the language model's layers: all-reduce, all-gather (NCCL on GPUs, gloo on the CPU)
  lm_control     the step plan rank 0 sends every step (pickled, on gloo: it is host data)
  vision         the vision tower's tensors, used from the image-encoder thread while `lm` is busy in the main one
  vision_control the image jobs rank 0 sends to that thread
Two threads must never share a group (collectives on one group are matched by order), hence the pairs; the
control groups are separate from the tensor ones even on the CPU, so that a rank out of step gets an error or a
timeout instead of a message paired with somebody's all-reduce.

Layers take their group from `tensor_parallel(...)` while they are built and keep it: the model code builds its
layers as usual, and the same code serves world size 1 (no communication at all).

A step (or a vision tower run) that fails after rank 0 sent it leaves the ranks in step only if every rank made as
many collectives before it stopped (a failure of the job itself, met by every rank at the same place):
`ParallelGroups.one_step` has them compare their counts then, and raises RanksOutOfStep when they differ or a rank
does not answer.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# workers wait on the control groups between requests: an idle server must not time out (a dead peer is still
# noticed at once: its connections close). The other groups wait at most for the slowest rank to load its weights.
IDLE_TIMEOUT = datetime.timedelta(days=365)
START_TIMEOUT = datetime.timedelta(minutes=30)
# after a failed step a rank that failed too answers at once; one that does not is stuck in a collective
SETTLE_TIMEOUT_S = 10.0


class RanksOutOfStep(RuntimeError):
    """A step failed with the ranks at different collectives: the next step's would be paired with this one's."""


@dataclass
class FailedStep:
    """Rank 0's message after a job (a step, a vision tower run) that failed there: the collectives it made in it."""

    calls: int


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group; SINGLE (no group) means no communication."""

    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed.ProcessGroup
    # False for SINGLE; a real group of one rank still calls its collectives (to measure their cost). A field,
    # not a property: layers read it in every forward
    communicates: bool = field(init=False)
    calls: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)  # collectives made so far

    def __post_init__(self):
        object.__setattr__(self, "communicates", self.group is not None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.communicates:
            self.calls[0] += 1
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' pieces side by side along the last dimension."""
        if not self.communicates:
            return x
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        self.gather_into(pieces, x.contiguous())
        return torch.cat(pieces, dim=-1)

    def gather_into(self, pieces: list[torch.Tensor], x: torch.Tensor) -> None:
        """Each rank's `x` into `pieces` (one per rank)."""
        self.calls[0] += 1
        dist.all_gather(pieces, x, group=self.group)


SINGLE = TPGroup()
_building: TPGroup = SINGLE


def current_tp() -> TPGroup:
    """The group of the layers being built now."""
    return _building


@contextlib.contextmanager
def tensor_parallel(group: TPGroup) -> Iterator[None]:
    global _building
    previous, _building = _building, group
    try:
        yield
    finally:
        _building = previous


@dataclass(frozen=True)
class ParallelGroups:
    rank: int
    size: int
    lm: TPGroup
    vision: TPGroup  # sharded tower: the vision group; data-parallel tower (mm_encoder_tp_mode=data): SINGLE
    vision_data: TPGroup  # the vision group whatever the mode: a data-parallel tower gathers its images over it
    lm_control: object
    vision_control: object

    def send(self, message: object, control: object, timeout_s: float | None = None) -> object:
        """Rank 0 passes `message`; every rank gets it back (a worker passes None and waits for it). With
        `timeout_s`, raises when the other ranks do not take part within it."""
        payload = pickle.dumps(message) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        _wait(dist.broadcast(size, src=0, group=control, async_op=True), timeout_s)
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.empty(int(size), dtype=torch.uint8)
        )
        _wait(dist.broadcast(data, src=0, group=control, async_op=True), timeout_s)
        return message if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.lm.calls[0] += 1
        dist.broadcast(tensor, src=0, group=self.lm.group)
        return tensor

    @contextlib.contextmanager
    def one_step(self, control: object, group: TPGroup, what: str = "step") -> Iterator[None]:
        """Rank 0, around the collectives on `group` of a job it has sent on `control` (a step, a vision tower
        run): when the job fails, the ranks settle whether they are still in step (`settle`); if not,
        RanksOutOfStep replaces the job's own error."""
        start = group.calls[0]
        try:
            yield
        except Exception as error:
            calls = group.calls[0] - start
            try:
                self.send(FailedStep(calls), control, SETTLE_TIMEOUT_S)
                in_step = self.settle(calls, control, SETTLE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a rank that does not answer is stuck in a collective
                in_step = False
            if not in_step:
                raise RanksOutOfStep(
                    f"a {what} failed ({type(error).__name__}: {error}) with the tensor-parallel ranks at different "
                    "collectives: the engine cannot go on with them"
                ) from error
            raise

    def settle(self, calls: int, control: object, timeout_s: float | None = None) -> bool:
        """Every rank, after a failed job: whether each made `calls` collectives in it (each passes its own)."""
        box = torch.tensor([calls, -calls], dtype=torch.int64)
        _wait(dist.all_reduce(box, op=dist.ReduceOp.MAX, group=control, async_op=True), timeout_s)
        return int(box[0]) == calls == -int(box[1])

    def min_over_ranks(self, value: int) -> int:
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.lm_control)
        return int(box.item())


def join_groups(
    rank: int,
    size: int,
    address: str,
    port: int,
    device: torch.device,
    mm_encoder_tp_mode: str,
    check_workers: Callable[[], None] | None = None,
) -> ParallelGroups:
    """Joins the process group (rank 0 hosts the rendezvous store at address:port) and makes the four groups.
    Rank 0 waits for the workers to connect, calling `check_workers` meanwhile (it raises when one died)."""
    gloo = device.type == "cpu"
    if not gloo and device.index is None:  # NCCL binds to a numbered device: rank 0's is the current one
        device = torch.device(device.type, torch.cuda.current_device())
    store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=START_TIMEOUT, wait_for_workers=False)
    if rank == 0:
        while size > 1 and not store.check([f"joined/{r}" for r in range(1, size)]):
            if check_workers is not None:
                check_workers()
            time.sleep(0.1)
    else:
        store.set(f"joined/{rank}", "1")
    dist.init_process_group(
        "gloo" if gloo else "nccl",
        store=store,
        rank=rank,
        world_size=size,
        timeout=START_TIMEOUT,
        device_id=None if gloo else device,
    )
    world = dist.group.WORLD
    lm_control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    vision = dist.new_group(backend="gloo" if gloo else "nccl", timeout=START_TIMEOUT)
    vision_control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    vision_group = TPGroup(rank, size, vision)
    return ParallelGroups(
        rank,
        size,
        TPGroup(rank, size, world),
        vision_group if mm_encoder_tp_mode == "weights" else SINGLE,
        vision_group,
        lm_control,
        vision_control,
    )


def _wait(work, timeout_s: float | None) -> None:
    work.wait() if timeout_s is None else work.wait(datetime.timedelta(seconds=timeout_s))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
