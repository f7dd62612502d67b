"""Analytic FLOP counts of one PPO iteration, and the device's measured matmul peak.

Counting convention (multiply-add = 2 FLOPs; matmuls only, element-wise ops ignored). For a
model with ``L`` layers, width ``d``, vocabulary ``V`` and ``W`` weights in each layer's
matrix products (GPT-2: ``12 d^2``; Qwen2: Q, K, V, O projections and a 3-matrix MLP):

- trunk, per token and forward: ``2 L W`` (GPT-2: ``24 L d^2``: QKV ``6 d^2``, attention
  output ``2 d^2``, MLP ``16 d^2``, per layer), i.e. ``2 x (trunk parameters without
  embeddings) x tokens``;
- attention, per sequence of ``T`` tokens and forward: ``4 L d T^2`` (``Q K^T`` and
  ``softmax x V`` over the full ``T x T`` score matrix, as the masked kernel computes it);
  one decoding step against ``t`` cached positions costs ``4 L d t``;
- LM head: ``2 d V`` per position whose logits are computed (``logits_to_keep``);
- classifier / value head: ``2 d`` per position it is applied to;
- backward = 2 x forward, so a training pass counts 3 x the forward FLOPs.

Each library is charged for the work it executes (TRL computes logits at every position and
runs a separate value trunk; both take the rollout-time log-probs from the sampling logits), so
the peak fractions say how well each uses the machine, and ``gflop_per_iter`` shows the work
each chooses to do for the same PPO iteration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """Model and batch sizes of the benchmark."""

    layers: int
    width: int
    vocab: int
    batch: int
    prompt: int
    response: int
    epochs: int
    layer_weights: int = 0  # weights of one layer's matrix products; 0: GPT-2's 12 width^2

    @classmethod
    def of(cls, preset) -> Shape:
        """The shape of a ``bench_world.Preset``."""
        return cls(
            preset.layers,
            preset.width,
            preset.vocab,
            preset.batch,
            preset.prompt,
            preset.response,
            preset.epochs,
            preset.layer_weights,
        )

    @property
    def seq(self) -> int:
        """Prompt plus response tokens."""
        return self.prompt + self.response


def _trunk(s: Shape, tokens: int) -> float:
    weights = s.layer_weights or 12 * s.width**2
    return 2.0 * s.layers * weights * tokens


def _attn(s: Shape, seqs: int, length: int) -> float:
    return 4.0 * s.layers * s.width * length**2 * seqs


def _head(s: Shape, positions: int, outputs: int) -> float:
    return 2.0 * s.width * outputs * positions


def forward(s: Shape, seqs: int, length: int, logit_positions: int, head_outputs: int) -> float:
    """One forward over ``seqs`` sequences of ``length`` tokens."""
    return (
        _trunk(s, seqs * length)
        + _attn(s, seqs, length)
        + _head(s, seqs * logit_positions, head_outputs)
    )


def rollout(s: Shape) -> float:
    """KV-cache sampling: a prefill with logits at the last prompt position, then R-1 steps."""
    total = forward(s, s.batch, s.prompt, 1, s.vocab)
    for step in range(1, s.response):
        context = s.prompt + step
        total += _trunk(s, s.batch) + 4.0 * s.layers * s.width * context * s.batch
        total += _head(s, s.batch, s.vocab)
    return total


def trunk(s: Shape, seqs: int, length: int) -> float:
    """The trunk alone (no LM head) over ``seqs`` sequences of ``length`` tokens."""
    return _trunk(s, seqs * length) + _attn(s, seqs, length)


def phases(s: Shape, side: str) -> dict[str, float]:
    """FLOPs per phase of one iteration for ``side`` in ``ours``, ``ours_separate_value``, ``trl``.

    ours: the sampling loop (its logits and hidden states are kept: no policy scoring pass);
    scoring runs the reference (logits at R+1 positions), the value head on the kept hidden
    states and the reward model (score head at every position, as the classifier computes it);
    each PPO epoch trains on all B sequences, the LM head at the R response positions. The
    separate-value variant adds a value trunk (no LM head) to scoring and to every epoch.
    trl: no policy scoring pass either (log-probs from the generation logits); reference logits
    at all T positions, value model and reward model (score head at all T positions), and per
    epoch a training pass of the policy (logits at all T positions) plus the value model.
    """
    b, t, r = s.batch, s.seq, s.response
    reward = forward(s, b, t, t, 1)
    if side == "trl":
        policy_train = forward(s, b, t, t, s.vocab) + forward(s, b, t, t, 1)
        score = forward(s, b, t, t, s.vocab) + forward(s, b, t, t, 1) + reward
    else:
        policy_train = forward(s, b, t, r, s.vocab) + _head(s, b * r, 1)
        score = forward(s, b, t, r + 1, s.vocab) + _head(s, b * r, 1) + reward
        if side == "ours_separate_value":
            policy_train += trunk(s, b, t)
            score += trunk(s, b, t)
    return {"rollout": rollout(s), "score": score, "update": 3.0 * s.epochs * policy_train}


def grpo_phases(s: Shape, side: str, device: str = "cpu") -> dict[str, float]:
    """FLOPs per phase of one GRPO iteration (``s.batch`` sampled sequences) of ``side``.

    ours_grpo: the sampling loop (log-probs from its logits: no policy scoring pass); scoring
    runs the reference (logits at R+1 positions) and the reward model; each epoch trains on all
    B sequences, the LM head at the R response positions.
    trl_grpo: an extra no-grad policy pass for the old log-probs (it takes them only so when
    an iteration has several optimizer steps per generation, as here), the reference and the
    reward model; TRL's fused log-prob head projects all T-1 positions off CUDA and the R
    completion positions on CUDA, in every pass.
    """
    b, t, r = s.batch, s.seq, s.response
    reward = forward(s, b, t, t, 1)
    if side == "trl_grpo":
        positions = r if device.startswith("cuda") else t - 1
        policy = forward(s, b, t, positions, s.vocab)
        score = 2 * policy + reward
    else:
        policy = forward(s, b, t, r, s.vocab)
        score = forward(s, b, t, r + 1, s.vocab) + reward
    return {"rollout": rollout(s), "score": score, "update": 3.0 * s.epochs * policy}


def matmul_peak(
    threads: int,
    sizes: tuple[int, ...] | None = None,
    repeats: int = 5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """The device's matmul peak in ``dtype``: the best GFLOP/s of square products.

    The best of several sizes and runs, because on a shared machine any single timing may be
    slowed down by other processes, never sped up. On a CPU in float32 the products are taken
    both by ``torch.mm`` (MKL) and by oneDNN (``rlkl_lightning.perf.onednn``), which is twice as
    fast where MKL lacks AVX-512 kernels: the peak is the faster one's. On a GPU each timing
    waits for the device (``torch.cuda.synchronize``) and the products are larger.
    """
    cuda = device.startswith("cuda")
    torch.set_num_threads(threads)
    sizes = sizes or ((4096, 8192) if cuda else (512, 1024, 2048))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runs = 10 if cuda else 1
    products = [lambda a, b, out: torch.mm(a, b, out=out)]
    if not cuda and dtype == torch.float32:
        from rlkl_lightning.perf import onednn as matmul

        if matmul.available():
            products.append(lambda a, b, out: matmul.product_t(a, b, onednn=True))
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        out = torch.empty(size, size, device=device, dtype=dtype)
        for product in products:
            product(a, b, out)
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                for _ in range(runs):
                    product(a, b, out)
                sync()
                best = max(best, 2.0 * size**3 * runs / (time.perf_counter() - start) / 1e9)
    return best
