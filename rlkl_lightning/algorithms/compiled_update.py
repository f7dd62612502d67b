"""The update's forward and backward passes as one compiled graph (``optimization.compile``).

Why: eagerly, a micro-batch's loss is hundreds of operators launched one at a time from
Python, many of them element-wise passes over the same tensors (the surrogate, the clips, the
KL term, the value loss) that a compiler fuses, forward and backward alike.

How: :class:`CompiledUpdate` calls the algorithm's own ``module.loss`` through
``torch.compile`` (``fullgraph=True``, static shapes), so the policy's forward pass, the fused
LM head (:class:`~rlkl_lightning.models.logprobs.TokenLogProbs`, which dynamo traces with its
backward), the value model and the loss are one graph; AOTAutograd compiles its backward pass
too, which ``manual_backward`` runs as usual. Beta (``kl_coef``) enters the graph as a tensor,
so a controller that moves it does not compile again.

Static shapes: every micro-batch is padded (:func:`pad_micro_batch`) to the largest micro-batch
of the run so far (rows) and to a bucket of prompt and response widths (:func:`bucket`:
``8, 12, 16, 24, 32, 48, ...``, at most the sampling limits), so a run compiles once per bucket
it meets, not once per batch. Padding adds only masked tokens: prompts on the left and
responses on the right, as the batch is already padded, and rows whose every mask is 0 ("fully
masked"); the losses, statistics and gradients are those of the micro-batch itself (to float
rounding: the sums run over more zeros).

With ``optimization.packing: packed`` the padded micro-batch's sequences are packed
(:func:`~rlkl_lightning.models.packing.pack`) outside the graph, which reads the data, into
rows of the padded width, their count rounded up by :func:`row_bucket` and filled with filler
rows (:func:`~rlkl_lightning.models.packing.pad_rows`); the graph takes the packed rows as
inputs. A run then compiles once per (width bucket, packed-row bucket) it meets.

Where it runs: with ``models.cpu_matmul: onednn`` (its products stay oneDNN's, opaque operators
of the graph), with LoRA adapters, under DDP, and with ``ppo.value_model_thread``: then the
policy's loss and the value model's term are two graphs, each compiled and run in its own
thread (:meth:`CompiledUpdate._in_two_threads`). Refused by name at fit start (:func:`check`):
FSDP (its units gather their weights in hooks the graph cannot hold), and on a CPU without a
C++ compiler.

The compiled code is kept on disk (inductor's FX graph cache) under the library's cache,
``$RLKL_CACHE/inductor`` (:func:`use_inductor_cache`), so a resumed run or the next run of a
study finds it instead of compiling again.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.models.forward import plain_lm_head_weight
from rlkl_lightning.models.packing import check_packable, pack, pad_rows
from rlkl_lightning.trajectory import Trajectory

OPTION = "optimization.compile"
#: The smallest prompt and response width a micro-batch is padded to.
MIN_BUCKET = 8
#: Graphs kept for one run (row counts x widths); one more raises instead of running eagerly.
RECOMPILE_LIMIT = 64
#: Inductor's variable for its cache directory, which :func:`use_inductor_cache` sets.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def bucket(width: int, limit: int, smallest: int = MIN_BUCKET) -> int:
    """``width`` rounded up to the next of ``8, 12, 16, 24, 32, 48, ...``, at most ``limit``.

    The buckets grow by factors of 1.5 and 4/3, so a run meets a few of them and padding adds
    at most half of a width; a width above ``limit`` (the sampling limit) stays as it is.
    ``smallest``: the first bucket.
    """
    size = smallest
    while size < width:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return max(width, min(size, limit))


def row_bucket(rows: int, limit: int) -> int:
    """``rows`` rounded up to the next of ``1, 2, 3, 4, 6, 8, 12, 16, ...``, at most ``limit``."""
    return bucket(rows, limit, smallest=min(rows, 4))


def pad_micro_batch(part: Trajectory, rows: int, prompt_width: int, response_width: int):
    """``part`` padded to ``rows`` x (``prompt_width`` + ``response_width``) masked tokens.

    Prompts get columns on the left, responses on the right, each with a 0 attention mask (the
    position ids follow the mask, so no real token moves). Added rows repeat the first row with
    its attention and response masks and its loss weights 0: finite values wherever a loss
    reads them, and no token that attends, is scored or weighs.
    """
    n, response = part.response_ids.shape
    prompt = part.input_ids.shape[1] - response
    left, right, more = prompt_width - prompt, response_width - response, rows - n
    if left < 0 or right < 0 or more < 0:
        raise ValueError(
            f"pad_micro_batch: a micro-batch of {n} x ({prompt} + {response}) tokens does not fit "
            f"{rows} x ({prompt_width} + {response_width})"
        )
    if not (left or right or more):
        return part
    masks = ("attention_mask", "response_mask", "loss_weights")
    fields = {}
    for name, value in part._asdict().items():
        if value is None:
            fields[name] = None
            continue
        if more:
            copies = value[:1].expand(more, *value.shape[1:])
            if name in masks:
                copies = torch.zeros_like(copies)
            value = torch.cat([value, copies])
        if value.ndim > 1 and value.shape[1] == prompt + response:
            value = torch.nn.functional.pad(value, (left, right))
        elif value.ndim > 1 and value.shape[1] == response:
            value = torch.nn.functional.pad(value, (0, right))
        fields[name] = value
    return type(part)(**fields)


def largest_micro_batch(rows: int, num_minibatches: int, grad_accum_steps: int) -> int:
    """The rows of an update's largest micro-batch (``update.split``'s pieces of pieces)."""
    return math.ceil(math.ceil(rows / num_minibatches) / grad_accum_steps)


def check(module: Any) -> None:
    """Raise ``ValueError`` naming the option where the compiled pass cannot run this module."""
    from lightning.pytorch.strategies import FSDPStrategy

    from rlkl_lightning.algorithms.compiled_decode import cpu_compiler_missing

    strategy = module.trainer.strategy
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            f"`{OPTION}` does not run under FSDPStrategy (its units gather their weights in "
            "hooks outside the graph); set compile=False"
        )
    if module.device.type == "cpu" and (missing := cpu_compiler_missing()) is not None:
        raise ValueError(
            f"`{OPTION}` on a CPU needs a C++ compiler for torch.compile's inductor (g++, or "
            f"one named by CXX): {missing}"
        )


def use_inductor_cache() -> Path:
    """Keep inductor's compiled code under the library's cache; returns the directory in use.

    ``$RLKL_CACHE/inductor`` (``~/.cache/rlkl_lightning/inductor``), unless
    ``TORCHINDUCTOR_CACHE_DIR`` names another directory than inductor's default (which
    importing dynamo writes there): then that one, the user's.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    from rlkl_lightning.world.cache import default_cache_dir

    current = os.environ.get(INDUCTOR_CACHE_ENV)
    if not current or os.path.abspath(current) == os.path.abspath(inductor_default()):
        os.environ[INDUCTOR_CACHE_ENV] = str(default_cache_dir() / "inductor")
    return Path(os.environ[INDUCTOR_CACHE_ENV])


def _loss(module: Any, part: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
    return module.loss(part)


def _policy_loss(module: Any, part: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
    return module.policy_objective(module.policy, part, module.kl_coef)


def _helper_loss(module: Any, part: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
    return module.helper_loss(part)


class CompiledUpdate:
    """A module's ``loss`` of a micro-batch, compiled with its backward pass for padded shapes.

    Args:
        prompt_limit: ``sampling.max_prompt_tokens``, the largest prompt bucket.
        response_limit: ``sampling.max_new_tokens``, the largest response bucket.
    """

    def __init__(self, prompt_limit: int, response_limit: int) -> None:
        self.prompt_limit = prompt_limit
        self.response_limit = response_limit
        #: The rows every micro-batch is padded to: the largest micro-batch so far.
        self.rows = 0
        self._beta: Tensor | None = None
        from rlkl_lightning.algorithms.compiled_decode import compile_fixed

        self._compiled = compile_fixed(_loss, RECOMPILE_LIMIT)
        #: With a helper thread (``ppo.value_model_thread``): the policy's graph, and the
        #: helper network's, each run and compiled in its own thread.
        self._compiled_policy = compile_fixed(_policy_loss, RECOMPILE_LIMIT)
        self._compiled_helper = compile_fixed(_helper_loss, RECOMPILE_LIMIT)

    def shape(self, part: Trajectory, rows: int) -> tuple[int, int, int]:
        """The padded ``(rows, prompt, response)`` of ``part``; ``rows``: its update's largest."""
        response = part.response_ids.shape[1]
        prompt = part.input_ids.shape[1] - response
        self.rows = max(self.rows, rows, part.response_ids.shape[0])
        return (
            self.rows,
            bucket(prompt, self.prompt_limit),
            bucket(response, self.response_limit),
        )

    def __call__(
        self, module: Any, part: Trajectory, rows: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``module.loss(part)`` of ``part`` padded (:meth:`shape`), compiled."""
        padded = pad_micro_batch(part, *self.shape(part, rows))
        plain_lm_head_weight(module.policy)  # its one-off check is a forward pass of its own
        objective = module.policy_objective
        if objective.packing != "none":  # packed here: packing reads the data (not a graph)
            check_packable(module.policy)
            width = padded.input_ids.shape[1]
            packed = pack(padded.attention_mask, padded.response_mask, padded.input_ids, width)
            count = row_bucket(packed.input_ids.shape[0], padded.input_ids.shape[0])
            objective.given_rows = pad_rows(packed, count)
        beta = module.kl_coef
        if self._beta is None:  # float32, as the float is cast to multiply a float32 term
            self._beta = torch.zeros((), dtype=torch.float32, device=module.device)
        self._beta.fill_(beta)
        module.kl_coef = self._beta  # read by the graph as an input, not a constant
        try:
            if module.threads.has_helper:
                return self._in_two_threads(module, padded)
            return self._compiled(module, padded)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as err:  # a graph break
            first = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(
                f"`{OPTION}`: {type(module).__name__}.loss does not compile as one graph "
                f"({first}); set compile=False"
            ) from err
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            raise ValueError(
                f"`{OPTION}`: more than {RECOMPILE_LIMIT} shapes of micro-batches compiled in "
                "this process; set compile=False"
            ) from err
        finally:
            module.kl_coef = beta
            objective.given_rows = None

    def _in_two_threads(self, module: Any, padded: Trajectory) -> tuple[Tensor, dict[str, Tensor]]:
        """The helper network's graph in the helper thread, beside the policy's in this one.

        Its term joins the loss as the helper's leaf (``ValueThread.handoff``), added last, so
        its backward pass runs in the helper too; ``loss/total`` is the sum's.
        """
        threads = module.threads
        side = threads.submit(self._compiled_helper, module, padded)
        try:
            loss, stats = self._compiled_policy(module, padded)
        except BaseException:  # the helper reads the packed rows until it is done: wait
            with contextlib.suppress(Exception):
                side.result()
            raise
        term, extra = side.result()
        loss = loss + threads.handoff(term)
        return loss, {**stats, **extra, keys.LOSS_TOTAL: loss.detach()}
