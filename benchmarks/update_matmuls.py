"""How fast can the PPO update's matrix products run on this machine, outside the model?

The throughput benchmark's update phase (``ppo_throughput.py``) is 145 GFLOP of matrix
products per iteration. This script times those products alone, with the benchmark's shapes
(minibatches of 8 sequences x 48 tokens = 384 rows, width 256, 4 layers, vocabulary 4096, the
LM head on the 256 response rows), forward and both backward products, against the machine's
square-matmul peak measured the same way as the benchmark (``flops.matmul_peak``). Each product
is timed with PyTorch's default float32 kernel (``torch.mm``, MKL in the x86 wheels) and with
oneDNN's (``cpu_matmul="onednn"``, :mod:`rlkl_lightning.perf.onednn`), whose operands it takes in a
linear layer's layout. The result bounds what any fp32 implementation of the same update can
reach here with either kernel.

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

from rlkl_lightning.perf import onednn as matmul  # noqa: E402

THREADS, ROWS, WIDTH, LAYERS, VOCAB, RESPONSE_ROWS = 2, 384, 256, 4, 4096, 256
# name -> (rows, inner, columns) of the forward product, and how often it runs per minibatch
PRODUCTS = {
    "attention qkv": ((ROWS, WIDTH, 3 * WIDTH), LAYERS),
    "attention output": ((ROWS, WIDTH, WIDTH), LAYERS),
    "mlp up": ((ROWS, WIDTH, 4 * WIDTH), LAYERS),
    "mlp down": ((ROWS, 4 * WIDTH, WIDTH), LAYERS),
    "lm head": ((RESPONSE_ROWS, WIDTH, VOCAB), 1),
}


def gflops(m: int, k: int, n: int, onednn: bool, repeats: int = 200) -> float:
    """Best-of-three GFLOP/s of ``[m, k] @ [k, n]`` (oneDNN: the right operand as ``[n, k]``)."""
    a, b = torch.randn(m, k), torch.randn(n, k)
    right = b.t().contiguous()

    def product() -> torch.Tensor:
        return matmul.product_t(a, b, onednn=True) if onednn else a @ right

    for _ in range(10):
        product()
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            product()
        best = max(best, 2.0 * m * k * n * repeats / (time.perf_counter() - start) / 1e9)
    return best


def main() -> None:
    torch.set_num_threads(THREADS)
    peak = flops.matmul_peak(THREADS)
    print(f"fp32 square-matmul peak, {THREADS} threads: {peak:.1f} GFLOP/s")
    kernels = {"torch.mm": False, "oneDNN": True} if matmul.available() else {"torch.mm": False}
    total_flop, total_s = 0.0, dict.fromkeys(kernels, 0.0)
    for name, ((m, k, n), count) in PRODUCTS.items():
        # forward x W, gradient of the input (dY W^T), gradient of the weight (X^T dY)
        products = ((m, k, n), (m, n, k), (k, m, n))
        flop = sum(2.0 * a * b * c for a, b, c in products)
        total_flop += flop * count
        rates = []
        for kernel, onednn in kernels.items():
            seconds = sum(2.0 * a * b * c / (gflops(a, b, c, onednn) * 1e9) for a, b, c in products)
            total_s[kernel] += seconds * count
            rate = flop / seconds / 1e9
            rates.append(f"{kernel} {rate:6.1f} GFLOP/s = {rate / peak:4.0%}")
        print(f"{name:>17}, forward + backward: " + ", ".join(rates) + " of peak")
    for kernel, seconds in total_s.items():
        rate = total_flop / seconds / 1e9
        print(f"all update products, {kernel}: {rate:.1f} GFLOP/s = {rate / peak:.0%} of peak")


if __name__ == "__main__":
    main()
