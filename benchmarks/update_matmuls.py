"""How fast can the PPO update's matrix products run on this machine, outside the model?

The throughput benchmark's update phase (``ppo_throughput.py``) is 145 GFLOP of matrix
products per iteration. This script times those products alone, with the benchmark's shapes
(minibatches of 8 sequences x 48 tokens = 384 rows, width 256, 4 layers, vocabulary 4096, the
LM head on the 256 response rows), forward and both backward products, against the machine's
square-matmul peak measured the same way as the benchmark (``flops.matmul_peak``). The result
bounds what any fp32 implementation of the same update can reach here.

Usage::

    python benchmarks/update_matmuls.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flops  # noqa: E402

THREADS, ROWS, WIDTH, LAYERS, VOCAB, RESPONSE_ROWS = 2, 384, 256, 4, 4096, 256
# name -> (rows, inner, columns) of the forward product, and how often it runs per minibatch
PRODUCTS = {
    "attention qkv": ((ROWS, WIDTH, 3 * WIDTH), LAYERS),
    "attention output": ((ROWS, WIDTH, WIDTH), LAYERS),
    "mlp up": ((ROWS, WIDTH, 4 * WIDTH), LAYERS),
    "mlp down": ((ROWS, 4 * WIDTH, WIDTH), LAYERS),
    "lm head": ((RESPONSE_ROWS, WIDTH, VOCAB), 1),
}


def gflops(m: int, k: int, n: int, repeats: int = 200) -> float:
    """Best-of-three GFLOP/s of ``[m, k] @ [k, n]``."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(10):
        a @ b
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2.0 * m * k * n * repeats / (time.perf_counter() - start) / 1e9)
    return best


def main() -> None:
    torch.set_num_threads(THREADS)
    peak = flops.matmul_peak(THREADS)
    print(f"fp32 square-matmul peak, {THREADS} threads: {peak:.1f} GFLOP/s")
    total_flop = total_s = 0.0
    for name, ((m, k, n), count) in PRODUCTS.items():
        # forward x W, gradient of the input (dY W^T), gradient of the weight (X^T dY)
        products = ((m, k, n), (m, n, k), (k, m, n))
        flop = sum(2.0 * a * b * c for a, b, c in products)
        seconds = sum(2.0 * a * b * c / (gflops(a, b, c) * 1e9) for a, b, c in products)
        total_flop += flop * count
        total_s += seconds * count
        rate = flop / seconds / 1e9
        print(f"{name:>17}: forward + backward {rate:6.1f} GFLOP/s = {rate / peak:4.0%} of peak")
    rate = total_flop / total_s / 1e9
    print(f"all update products: {rate:.1f} GFLOP/s = {rate / peak:.0%} of peak")


if __name__ == "__main__":
    main()
