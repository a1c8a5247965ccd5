"""What bounds a decode step's projections: one layer's q/k/v, o, gate/up and down GEMMs
(Qwen2.5-0.5B's shapes, bf16, cuBLAS as the engine calls them) at 256 and 64 rows, run
once each inside a profiler range for Nsight Compute to read their L2 and DRAM bytes and
throughputs:

    ncu --profile-from-start off --clock-control none \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats \\
        --metrics lts__t_bytes.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \\
        python3 -m benchmarks.rollout.projections_ncu

Without ncu it prints each projection's operand bytes, so the profile's L2 bytes can be
read against what one pass over the weights and activations would move.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, QKV = 896, 4864, 1152
SHAPES = {  # name: (out features, in features)
    "qkv": (QKV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}


def main() -> None:
    device = torch.device("cuda")
    weights = {
        name: torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for name, (n, k) in SHAPES.items()
    }
    for rows in (256, 64):
        inputs = {
            name: torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            for name, (_, k) in SHAPES.items()
        }
        for name in SHAPES:  # warm-up: cuBLAS picks its kernels and workspaces
            F.linear(inputs[name], weights[name])
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for name in SHAPES:
            torch.cuda.nvtx.range_push(f"{name}_{rows}")
            F.linear(inputs[name], weights[name])
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        for name, (n, k) in SHAPES.items():
            w_mb = n * k * 2 / 1e6
            a_mb = rows * k * 2 / 1e6
            out_mb = rows * n * 2 / 1e6
            print(
                f"{name} rows={rows}: weights {w_mb:.2f} MB, input {a_mb:.2f} MB, "
                f"output {out_mb:.2f} MB, {2 * rows * n * k / 1e9:.2f} GFLOP",
                flush=True,
            )


if __name__ == "__main__":
    main()
