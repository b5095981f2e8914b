"""The engine process's per-step message to the front end (issue 54): what it costs the engine process to send
it, today's way (a `StepOutputs` of `RequestOutput`s, pickled down a multiprocessing pipe) against msgspec
(msgpack) structs of the same content down a pyzmq socket (vLLM's choice), and against the compact message the
redesign sends (ids and finish reasons, the front end detokenizes), both ways.

    pip install msgspec pyzmq   # not fovea's dependencies: only this measurement needs them
    python benchmarks/ipc_step_message.py --out FILE [--batches 16,64,256] [--messages 3000]

Per message: the sender's encode and send time (the engine process's main thread: on the critical path of an
in-order step), and the receiver's decode time (the front end), medians over `--messages` sends of a streaming
step (every request a one-token delta with its text) and of a non-streaming one (no outputs, the stats only). The
receiver runs in its own process and reads as fast as it can; both sides use one core each on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import time
from pathlib import Path

import msgspec
import zmq

from fovea.core.messages import StepOutputs
from fovea.core.request import CompletionOutput, RequestOutput
from fovea.core.stats import EngineStats, LatencyEvents

ENDPOINT = "ipc:///tmp/fovea-ipc-bench"


class Completion(msgspec.Struct, array_like=True):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None


class Output(msgspec.Struct, array_like=True):
    request_id: str
    completions: list[Completion]
    finished: bool
    num_cached_tokens: int


class Stats(msgspec.Struct, array_like=True):
    gauges: list[int]
    time_to_first_token: list[float]
    inter_token: list[float]
    iteration_tokens: list[int]


class Step(msgspec.Struct, array_like=True):
    outputs: list[Output]
    stats: Stats


class CompactStep(msgspec.Struct, array_like=True):
    """The redesign's message: per row the request's index, its new token and a finish code (0: running)."""

    rows: list[int]
    tokens: list[int]
    finished: list[int]
    stats: Stats


def step_message(batch: int, streaming: bool) -> StepOutputs:
    events = LatencyEvents(inter_token=[0.012] * batch, iteration_tokens=[batch])
    stats = EngineStats(batch, 0, 4000, 9000, 10**6, 5 * 10**5, 0, 0, 0, 0, events, 10**4)
    outputs = [
        RequestOutput(
            f"chatcmpl-{i:032x}", None, [], None, [CompletionOutput(0, " word", [1234 + i], None, None)], False
        )
        for i in range(batch if streaming else 0)
    ]
    return StepOutputs(outputs, stats)


def as_structs(message: StepOutputs) -> Step:
    s, e = message.stats, message.stats.events
    stats = Stats([s.num_running, s.num_waiting, s.kv_used_blocks, s.kv_total_blocks], e.time_to_first_token,
                  e.inter_token, e.iteration_tokens)  # fmt: skip
    outputs = [
        Output(
            o.request_id,
            [Completion(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs],
            o.finished,
            o.num_cached_tokens,
        )  # fmt: skip
        for o in message.outputs
    ]
    return Step(outputs, stats)


def compact(message: StepOutputs) -> CompactStep:
    step = as_structs(message)
    rows = list(range(len(message.outputs)))
    return CompactStep(rows, [o.outputs[0].token_ids[0] for o in message.outputs], [0] * len(rows), step.stats)


def receive_pipe(conn, count: int, done) -> None:
    times = []
    for _ in range(count):
        data = conn.recv_bytes()
        start = time.perf_counter()
        pickle.loads(data)
        times.append(time.perf_counter() - start)
    done.send(statistics.median(times))


def receive_zmq(kind: str, count: int, done) -> None:
    socket = zmq.Context().socket(zmq.PULL)
    socket.bind(ENDPOINT)
    decoder = msgspec.msgpack.Decoder(CompactStep if kind == "compact" else Step)
    done.send("ready")
    times = []
    for _ in range(count):
        data = socket.recv(copy=False)
        start = time.perf_counter()
        decoder.decode(data.buffer)
        times.append(time.perf_counter() - start)
    done.send(statistics.median(times))


def measure_pipe(message, count: int) -> dict:
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    done_receive, done_send = context.Pipe(duplex=False)
    process = context.Process(target=receive_pipe, args=(receiver, count, done_send))
    process.start()
    encode, send = [], []
    for _ in range(count):  # Connection.send is pickle.dumps then send_bytes: timed apart
        start = time.perf_counter()
        data = pickle.dumps(message)
        middle = time.perf_counter()
        sender.send_bytes(data)
        encode.append(middle - start)
        send.append(time.perf_counter() - middle)
    decode = done_receive.recv()
    process.join()
    return {"bytes": len(pickle.dumps(message)), "encode_us": statistics.median(encode) * 1e6,
            "send_us": statistics.median(send) * 1e6, "decode_us": decode * 1e6}  # fmt: skip


def measure_zmq(message, kind: str, count: int) -> dict:
    context = multiprocessing.get_context("spawn")
    done_receive, done_send = context.Pipe(duplex=False)
    process = context.Process(target=receive_zmq, args=(kind, count, done_send))
    process.start()
    assert done_receive.recv() == "ready"
    socket = zmq.Context().socket(zmq.PUSH)
    socket.connect(ENDPOINT)
    encoder = msgspec.msgpack.Encoder()
    encode, send = [], []
    message = compact(message) if kind == "compact" else as_structs(message)  # as the engine would build it
    for _ in range(count):
        start = time.perf_counter()
        data = encoder.encode(message)
        middle = time.perf_counter()
        socket.send(data, copy=False)
        encode.append(middle - start)
        send.append(time.perf_counter() - middle)
    decode = done_receive.recv()
    process.join()
    return {"bytes": len(data), "encode_us": statistics.median(encode) * 1e6,
            "send_us": statistics.median(send) * 1e6, "decode_us": decode * 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--messages", type=int, default=3000)
    args = parser.parse_args()
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for streaming in (True, False):
            message = step_message(batch, streaming)
            ways = {
                "pickle + pipe (today)": lambda: measure_pipe(message, args.messages),
                "msgspec + zmq": lambda: measure_zmq(message, "full", args.messages),
                "compact, pickle + pipe": lambda: measure_pipe(compact(message), args.messages),
                "compact, msgspec + zmq": lambda: measure_zmq(message, "compact", args.messages),
            }
            for way, run in ways.items():
                result = {"batch": batch, "streaming": streaming, "way": way, **run()}
                results.append(result)
                print(f"{batch:4} {'stream' if streaming else 'final ':6} {way:24} {result['bytes']:7} B  encode "
                      f"{result['encode_us']:7.1f} us  send {result['send_us']:6.1f} us  decode "
                      f"{result['decode_us']:7.1f} us", flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps({"messages": args.messages, "results": results}, indent=2))


if __name__ == "__main__":
    main()
