"""One decode step as groups of rows that run side by side on their own CUDA streams.

At a few hundred rows the step's GEMMs are short of work: o_proj's (256, 896) output is 14
tiles of 128 x 128 for 132 SMs, and each of the ~240 kernels of a step waits for the one
before it. The rows of a decode step never meet, though (each attends only to its own
slot), so the batch can be cut into groups that run the whole model independently: while
one group's attention reads its keys, another's GEMMs use the SMs it leaves idle. This is
the "two-batch overlap" of serving engines, here inside the step's CUDA graph: a fork
into side streams after the inputs are written, a join before sampling.

Each group writes its rows of one logits buffer (no copy afterwards). Off CUDA the groups
run one after another, which is how the CPU tests check the cutting against the whole
batch. A group's numbers equal the whole batch's up to the GEMMs' choice of kernel for its
row count (bf16 rounding; float32 on CPU agrees to a few ulps).
"""

from __future__ import annotations

import torch

from services.rollout.decoder import StaticDecoder

ROW_ALIGN = 16
"""Groups are cut at multiples of this many rows (whole GEMM row tiles)."""


def row_groups(rows: int, parts: int, align: int = ROW_ALIGN) -> list[tuple[int, int]]:
    """[lo, hi) bounds of up to ``parts`` near-equal groups covering ``rows`` rows, each cut
    at a multiple of ``align`` (the last takes the rest); fewer groups when rows are few.

    >>> row_groups(256, 2)
    [(0, 128), (128, 256)]
    >>> row_groups(40, 2)
    [(0, 32), (32, 40)]
    """
    if rows <= 0 or parts < 1:
        raise ValueError(f"row_groups needs rows > 0 and parts >= 1, got {rows}, {parts}")
    size = -(-rows // parts)
    size = -(-size // align) * align
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]


class SplitDecode:
    """:meth:`StaticDecoder.decode` over row groups, one CUDA stream each (group 0 on the
    caller's stream). Captured in a graph, the streams become parallel branches of it."""

    def __init__(self, decoder: StaticDecoder, parts: int):
        if parts < 2:
            raise ValueError(f"SplitDecode needs parts >= 2, got {parts}")
        self.decoder = decoder
        self.parts = parts
        self.streams: list[torch.cuda.Stream] = []
        if decoder.device.type == "cuda":
            # Made once: a graph replays on the streams it was captured with.
            self.streams = [torch.cuda.Stream(decoder.device) for _ in range(parts - 1)]

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """Logits (bs, V) of one step, as :meth:`StaticDecoder.decode` takes its arguments
        (caches (layers, slots, kvh, L, d); row s is slot s)."""
        dec = self.decoder
        bs = tokens.shape[0]
        vocab = dec.lm_head.weight.shape[0]
        logits = torch.empty(bs, vocab, dtype=dec.dtype, device=tokens.device)
        groups = row_groups(bs, self.parts)

        def run(lo: int, hi: int) -> None:
            h = dec.decode_hidden(
                tokens[lo:hi], positions[lo:hi], k_cache[:, lo:hi], v_cache[:, lo:hi], width
            )
            dec.logits(h, out=logits[lo:hi])

        if not self.streams:
            for lo, hi in groups:
                run(lo, hi)
            return logits
        main = torch.cuda.current_stream()
        side = self.streams[: len(groups) - 1]
        for stream, (lo, hi) in zip(side, groups[1:], strict=True):
            stream.wait_stream(main)  # the inputs are written on the caller's stream
            with torch.cuda.stream(stream):
                run(lo, hi)
        run(*groups[0])
        for stream in side:
            main.wait_stream(stream)
        return logits
