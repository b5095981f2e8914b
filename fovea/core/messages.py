"""What the front end and an engine process say to each other over their two pipes (engine/engine_core.py,
frontend/engine_process.py), one dataclass per message.

front end -> engine:  AddRequest, AbortRequests, RemoveLoRA, Profile, ResetCache, Shutdown
engine -> front end:  Ready (once, after start-up) or StartFailed; then StepOutputs after every step, Rejected for a
                      request the engine cannot take, RequestsFailed for the requests of a step that raised; last, Dead
                      (it gave up after several failed steps: the front end starts a new engine) or Fatal (a
                      tensor-parallel worker stopped: no restart can help, the server exits)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fovea.core.request import RequestInput
from fovea.core.stats import EngineStats

if TYPE_CHECKING:
    from fovea.config.engine import EngineConfig


@dataclass
class AddRequest:
    request: RequestInput  # fully prepared: token ids, positions, resized pixels


@dataclass
class AbortRequests:
    request_ids: list[str]  # ids the engine does not know are ignored


@dataclass
class RemoveLoRA:
    lora_int_id: int  # an adapter the server unloaded: no new request names it


@dataclass
class Profile:
    start: bool  # /start_profile (True) or /stop_profile (False): engine/profiler.py


@dataclass
class ResetCache:
    """vLLM's development routes: forget the cached KV blocks ("prefix"; refused, and logged, while any is held)
    or the encoder outputs no running request needs ("mm")."""

    kind: str


@dataclass
class Shutdown:
    """Stop after the current step; what runs is dropped."""


@dataclass
class Ready:
    config: EngineConfig  # as the engine settled it (max_model_len lowered to what the KV cache holds)


@dataclass
class StartFailed:
    traceback: str


@dataclass
class StepOutputs:
    outputs: list[tuple]  # RequestDelta tuples: the front end makes the RequestOutputs (frontend/outputs.py)
    stats: EngineStats
    held: HeldRequests | None = None  # on going idle and every HELD_EVERY_S while busy


@dataclass
class HeldRequests:
    """How many AddRequests the engine had read and the ids it still holds: any other request among those read is
    answered by the messages before this one. The front end fails those it sent and never heard of again (a bug,
    but an error for the client instead of a wait, even while the engine is busy with others)."""

    requests_read: int
    request_ids: set[str]


@dataclass
class Rejected:
    request_id: str
    message: str  # why it cannot run here (a ValueError's text: the client's fault)


@dataclass
class RequestsFailed:
    request_ids: list[str]
    message: str  # the error a step raised; the engine goes on without these requests


@dataclass
class Dead:
    traceback: str


@dataclass
class Fatal:
    message: str


ToEngine = AddRequest | AbortRequests | RemoveLoRA | Profile | ResetCache | Shutdown
FromEngine = Ready | StartFailed | StepOutputs | Rejected | RequestsFailed | Dead | Fatal
