"""Host data onto the device behind the work already queued there, without the host waiting for it."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A host list or array on `device` without waiting: a plain copy to a GPU waits for the work queued before it
    (the model's forward), so the host could not queue the sampler's kernels behind it. Through pinned memory the
    copy joins the queue instead (PyTorch's pinned allocator keeps the buffer until the copy is done). `dtype`:
    None keeps an array's own."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    host = host if dtype is None else host.to(dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
