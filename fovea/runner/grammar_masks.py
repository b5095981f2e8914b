"""A step's grammar masks: filled in llguidance's threads while the model runs, applied to the logits before
sampling (the matchers themselves are built by the engine's GrammarCompiler, fovea/engine/structured_outputs.py)."""

from __future__ import annotations

import concurrent.futures

from fovea.core.sampling_params import StructuredOutputsParams

_threads = None  # (llguidance's pool, which fills a batch's masks in parallel outside the GIL; a starter thread)


def _fill_threads():
    global _threads
    if _threads is None:
        import llguidance

        _threads = llguidance.LLExecutor(), concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")
    return _threads


class GrammarMasks:
    """The next-token masks of a step's constrained rows. Filling starts when the step is built and runs in
    llguidance's threads (they release the GIL) while the model runs: on a GPU the CPU work hides behind the
    forward pass; the sampler waits for them only once it has the logits, then applies them on the device."""

    def __init__(self, rows: list[int], matchers: list, vocab_size: int):
        # llguidance's numpy helpers fill a torch tensor's memory: its torch module would import torch.compile's
        # machinery (seconds of every process's start-up) for a kernel that only a GPU uses
        import llguidance.numpy as ln
        import torch

        self.rows = rows
        words = (vocab_size + 31) // 32
        self.bitmask = torch.full((len(rows), words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        pool, starter = _fill_threads()
        self._filled = starter.submit(
            ln.fill_next_token_bitmask_par, pool, list(zip(matchers, range(len(rows)))), self.bitmask.numpy()
        )

    @classmethod
    def start(cls, grammars: list, vocab_size: int) -> GrammarMasks | None:
        """Masks for the rows whose grammar (matcher) is not None; None when no row has one."""
        rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
        return cls(rows, [grammars[i] for i in rows], vocab_size) if rows else None

    def apply(self, logits) -> None:
        """Sets to -inf, in place, every token that a constrained row's grammar does not allow next."""
        import torch

        self._filled.result()
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        if self.rows == list(range(logits.shape[0])):  # every row constrained: no gather and scatter
            apply_bitmask(logits, bitmask)
            return
        index = torch.tensor(self.rows, device=logits.device)
        masked = logits[index]
        apply_bitmask(masked, bitmask)
        logits[index] = masked


def apply_bitmask(logits, bitmask) -> None:
    """-inf where a row's bit is 0 (bit j of word i: token 32 i + j). On a GPU, llguidance's kernel; on the CPU
    the same arithmetic eagerly: llguidance's is torch.compile'd, seconds of every process's start-up there for
    what the eager ops do in a millisecond a row."""
    import torch

    if logits.device.type != "cpu":
        import llguidance.torch as lt

        lt.apply_token_bitmask_inplace(logits, bitmask)
        return
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(bitmask.shape[0], -1)
    allowed = torch.nn.functional.pad(bits, (0, max(0, logits.shape[1] - bits.shape[1])))[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))  # past the mask's words: not allowed, as llguidance's


def warm_up_masks(compiler, vocab_size: int, device) -> None:
    """One mask applied to one row of logits on `device`: llguidance compiles that step (torch.compile) on its
    first use, seconds that would otherwise fall on the first structured request."""
    import torch

    masks = GrammarMasks.start([compiler.matcher(StructuredOutputsParams(choice=["a"]))], vocab_size)
    masks.apply(torch.zeros(1, vocab_size, device=device))
