"""`fovea bench serve --plot FILE.png`: TTFT and ITL distributions and output chunks per second over the run."""

from __future__ import annotations

import numpy as np

from fovea.bench.metrics import RequestResult, chunks_per_second


def plot(results: list[RequestResult], path: str, title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'fovea[bench]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    figure, (ttft, itl, rate) = plt.subplots(1, 3, figsize=(15, 4))
    ttft.hist([r.ttft * 1000 for r in done], bins=30)
    ttft.set(title="Time to first token", xlabel="ms", ylabel="requests")
    itl.hist([gap * 1000 for r in done for gap in r.itl], bins=50)
    itl.set(title="Inter-token latency", xlabel="ms", ylabel="chunks", yscale="log")
    series = chunks_per_second(results)
    rate.plot(np.arange(len(series)), series, drawstyle="steps-post")
    rate.set(title="Output chunks per second", xlabel="seconds since the first request", ylabel="chunks/s")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
