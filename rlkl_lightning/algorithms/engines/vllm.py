"""The vLLM rollout engine: vLLM in this process samples, the trainer's weights pushed into it.

``engine.kind="vllm"`` (docs/engines.md): :class:`VLLMRolloutEngine`, the
:class:`~rlkl_lightning.algorithms.engines.base.RolloutEngine` a module holds. One vLLM
``LLM`` per process (:class:`VLLMEngine`), built at fit start (or on the first rollout without
a trainer) from the policy's own config, with dummy weights: the policy's weights are
pushed from memory before every rollout that follows a change (an update, a resume, a
reference refresh), never read from disk. The push goes through the model runner's in-place
``reload_weights``, which feeds Hugging Face names and layouts through the vLLM model's own
``load_weights`` (vLLM's CPU backend repacks its weights after loading, so writing its
parameters directly is not enough); the prefix cache is reset after each push, so no keys or
values computed with the old weights are used again (RLOO/GRPO send each prompt ``k`` times).

A LoRA policy is pushed as merged tensors, ``W + scale B A``, computed out of place: the base
weights, which are the reference of such a policy, are never written.

Each response is its own request with its own seed, derived from (run seed, batch, rank, row):
vLLM gives the ``n`` children of one seeded request the same random stream, and a resumed run
must sample what the uninterrupted one did. With ``tensor_parallel_size`` > 1 a group of
contiguous ranks runs one sharded model: its ranks gather their prompts, send the same requests
with seeds from the group's index and the row in the gathered batch, and keep their own rows.
The trajectory has the native loop's layout
(:func:`~rlkl_lightning.algorithms.rollout.sample_and_score`); the engine's log-probs of its
samples are kept as ``sampler_logprobs``, and the pipeline computes the trainer's.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rlkl_lightning.algorithms.engines.base import ENGINES, RolloutEngine
from rlkl_lightning.algorithms.rollout import response_mask_after_eos
from rlkl_lightning.models.logprobs import TokenScores, score_tokens
from rlkl_lightning.models.sharding import is_fsdp
from rlkl_lightning.random_streams import random_streams_kept
from rlkl_lightning.trajectory import Trajectory

#: The one line a user without vLLM reads (the environment is built by the Makefile).
MISSING_VLLM = (
    "`engine.kind='vllm'` needs vLLM, which is not installed in this environment: build the "
    "vLLM environment with `make vllm-env` and run with `.venv-vllm/bin/python`, or set "
    "`engine.kind='native'`"
)

#: vLLM's ``dtype`` for each Lightning precision: the engine samples from the model the
#: trainer runs (vLLM's ``auto`` would make a float32 model half precision).
PRECISION_DTYPES = {
    "32-true": "float32",
    "32": "float32",
    "bf16-mixed": "bfloat16",
    "bf16-true": "bfloat16",
    "16-mixed": "float16",
    "16-true": "float16",
}


#: vLLM's switch for an engine core in a process of its own; the pushes need it in this one.
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


def import_vllm():
    """The ``vllm`` module, its engine kept in this process; else a ``RuntimeError``.

    Raises:
        RuntimeError: :data:`MISSING_VLLM` without vLLM; naming the variable if
            ``VLLM_ENABLE_V1_MULTIPROCESSING`` asks for a separate engine process.
    """
    if os.environ.setdefault(IN_PROCESS, "0") != "0":
        raise RuntimeError(
            f"`engine.kind='vllm'` runs vLLM's engine in the training process (the weights are "
            f"pushed from memory); {IN_PROCESS}={os.environ[IN_PROCESS]!r} asks for a separate "
            f"process: unset it or set it to 0"
        )
    try:
        import vllm

        vllm.LLM  # noqa: B018 (a folder named vllm on the path imports as an empty package)
    except (ImportError, AttributeError) as err:
        raise RuntimeError(MISSING_VLLM) from err
    return vllm


def request_seed(seed: int, batch: int, rank: int, row: int) -> int:
    """The seed of one response's request: the same (seed, batch, rank, row), the same seed."""
    digest = hashlib.blake2b(f"{seed}:{batch}:{rank}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # a non-negative int64


def group_seeds(seed: int, batch: int, group: int, rows: int) -> list[int]:
    """The seeds of a tensor-parallel group's gathered batch: one per row, from the group's index.

    Every rank of the group sends the same requests with these seeds; with
    ``tensor_parallel_size=1`` the group is the rank, and the seeds are the ones of one rank's
    rows (:func:`request_seed` with the rank).
    """
    return [request_seed(seed, batch, group, row) for row in range(rows)]


def check_tensor_parallel(size: int, world_size: int) -> None:
    """Refuse a tensor-parallel size that does not split the training ranks into whole groups.

    vLLM's groups are ``size`` contiguous training ranks (``external_launcher``), so ``size``
    must divide the number of processes; one process has no group of two (refused too).

    Raises:
        ValueError: Naming ``tensor_parallel_size`` and the world size.
    """
    if world_size % size:
        raise ValueError(
            f"`engine.kind.init_args.tensor_parallel_size`={size} must divide the training "
            f"world size, {world_size}: vLLM's groups are {size} contiguous training ranks; "
            f"use a divisor of {world_size} (1: one whole engine per rank)"
        )


def run_seed() -> int:
    """The ``seed_everything`` seed of this run (0 without one)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def engine_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of the weights the policy runs with, under Hugging Face names.

    Tied weights come once. Under ``FSDPStrategy`` each FSDP unit's full weights are gathered
    while the unit is walked (its own weights only, then its children's units one by one) and
    freed after: every rank must read the whole iterator, in the same order (a collective);
    the names are those of the unsharded model. A PEFT tuner layer (LoRA and the other methods with
    ``get_delta_weight``) gives its base weight plus every active adapter's delta, computed
    out of place; a ``modules_to_save`` copy gives the active copy's weights under the
    original module's name. Nothing of ``model`` is written.

    Raises:
        ValueError: For an adapter method whose merged weight cannot be computed (naming
            ``models.peft``).
    """
    from_peft = _peft_kinds()
    seen: set[int] = set()

    def visit(module: nn.Module, prefix: str) -> Iterator[tuple[str, Tensor]]:
        if is_fsdp(module):  # a sharded unit: gathered while its weights are read
            from torch.distributed.fsdp import FullyShardedDataParallel

            with FullyShardedDataParallel.summon_full_params(
                module, recurse=False, writeback=False
            ):
                yield from visit(module._fsdp_wrapped_module, prefix)
            return
        if from_peft and isinstance(module, from_peft[0]):  # a tuner layer: merge
            yield from _merged(module, prefix)
            return
        if from_peft and isinstance(module, from_peft[1]):  # modules_to_save: the active copy
            module = module.modules_to_save[module.active_adapter]
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield prefix + name, param.detach()
        for name, child in module.named_children():
            yield from visit(child, f"{prefix}{name}.")

    def _merged(layer: nn.Module, prefix: str) -> Iterator[tuple[str, Tensor]]:
        base = layer.get_base_layer()
        if not hasattr(layer, "get_delta_weight"):
            raise ValueError(
                f"`models.peft`: {type(layer).__name__} adapters cannot be merged into the "
                "weights that `engine.kind='vllm'` samples with; use LORA, LOHA or LOKR, or "
                "`engine.kind='native'`"
            )
        weight = base.weight.detach()
        on = not (getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False))
        first = getattr(layer, layer.adapter_layer_names[0])  # e.g. lora_A: adapter -> module
        with torch.no_grad():
            for adapter in layer.active_adapters if on else ():
                if adapter in first:
                    weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
        seen.add(id(base.weight))
        yield prefix + "weight", weight
        for name, param in base.named_parameters(recurse=False):
            if name != "weight" and id(param) not in seen:
                seen.add(id(param))
                yield prefix + name, param.detach()

    yield from visit(model, "")


def _peft_kinds() -> tuple[type, type] | None:
    """PEFT's tuner-layer and ``modules_to_save`` wrapper classes (None without PEFT)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return None
    return BaseTunerLayer, ModulesToSaveWrapper


class VLLMEngine:
    """A vLLM ``LLM`` in this process that samples with the trainer's pushed weights.

    Built by :func:`shared_engine`, which keeps one per process.

    Args:
        config_dir: A directory with the policy's ``config.json`` (builds vLLM's model).
        max_model_len: Prompt plus response tokens.
        dtype: vLLM's dtype (:data:`PRECISION_DTYPES`).
        gpu_memory_utilization: ``engine.gpu_memory_utilization``.
        sleep_mode: Free the engine's memory between rollouts (CUDA only).
        device_type: Where the trainer runs (``cuda``: CUDA graphs; else eager).
        world_size: The training processes; above 1, one engine per rank through vLLM's
            ``external_launcher`` (:func:`set_rank_variables` first).
        tensor_parallel_size: The ranks of one vLLM group (:func:`launcher_arguments`).
    """

    def __init__(
        self,
        config_dir: str,
        *,
        max_model_len: int,
        dtype: str,
        gpu_memory_utilization: float,
        sleep_mode: bool,
        device_type: str,
        world_size: int = 1,
        tensor_parallel_size: int = 1,
    ) -> None:
        vllm = import_vllm()
        self.sleep_mode = sleep_mode
        #: Push weights before a rollout when they changed (a test switches it off).
        self.push_enabled = True
        #: Weight pushes so far.
        self.pushes = 0
        #: Whose weights, of which version, the engine holds: (module number, weights version).
        self.weights_of: tuple[int, int] | None = None
        self.llm = vllm.LLM(
            model=config_dir,
            load_format="dummy",  # the weights come from the trainer, never from disk
            skip_tokenizer_init=True,  # prompts are token ids; nothing is decoded here
            generation_config="vllm",  # no sampling defaults from the model's files
            dtype=dtype,
            seed=0,  # every request has a seed of its own
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            # On a CPU, vLLM's share counts the whole process's memory (a trainer's included):
            # the share of the RAM goes to the KV cache alone, stated explicitly.
            kv_cache_memory_bytes=_cpu_kv_cache_bytes(gpu_memory_utilization, device_type),
            enforce_eager=device_type != "cuda",
            enable_sleep_mode=sleep_mode,
            logprobs_mode="processed_logprobs",
            **launcher_arguments(world_size, tensor_parallel_size),
        )
        self._asleep = False

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def push(self, weights: Iterator[tuple[str, Tensor]], owner: tuple[int, int]) -> None:
        """Load ``weights`` (Hugging Face names) in place, then forget every cached key/value.

        ``owner``: (module, weights version), what :attr:`weights_of` records.
        """
        with random_streams_kept():
            self._wake()
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.collective_rpc(_repack_kept_cpu_weights)
            self.llm.reset_prefix_cache()
        self.pushes += 1
        self.weights_of = owner

    def sample(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        seeds: list[int],
        sampling: dict[str, Any],
        eos_token_id: int | None,
        pad_token_id: int,
        rows: slice = slice(None),
    ) -> tuple[Tensor, Tensor]:
        """Sample one response per row: ``[B, R]`` tokens and the engine's ``[B, R]`` log-probs.

        ``prompt_ids``/``prompt_mask``: ``[N, P]``, left padded, one seed per row; ``rows``: the
        ``B`` rows whose responses are returned (a tensor-parallel rank's own, of its group's
        gathered prompts; all of them by default). ``sampling``: temperature,
        top_k, top_p and max_new_tokens. A row stops at ``eos_token_id`` only (None: never),
        not at an EOS from the model's files. ``R`` is the longest response; shorter rows are
        padded with ``pad_token_id`` (log-prob 0).
        """
        vllm = import_vllm()
        self._wake()
        requests = [
            {"prompt_token_ids": row[keep.bool()].tolist()}
            for row, keep in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)
        ]
        shared = dict(
            temperature=sampling["temperature"],
            top_k=sampling["top_k"] or -1,
            top_p=sampling["top_p"],
            max_tokens=sampling["max_new_tokens"],
            ignore_eos=True,
            stop_token_ids=[eos_token_id] if eos_token_id is not None else [],
            logprobs=0,  # the sampled token's own log-prob
            detokenize=False,
        )
        params = [vllm.SamplingParams(seed=seed, **shared) for seed in seeds]
        with random_streams_kept():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = [out.outputs[0] for out in outputs][rows]
        length = max(len(s.token_ids) for s in samples)
        ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(samples), length, dtype=torch.float32)
        for i, sample in enumerate(samples):
            n = len(sample.token_ids)
            ids[i, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
            logprobs[i, :n] = torch.tensor(
                [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
            )
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._asleep = True
        return ids, logprobs


def group_prompts(
    prompt_ids: Tensor, prompt_mask: Tensor, rank: int, size: int
) -> tuple[Tensor, Tensor, slice]:
    """A tensor-parallel group's left-padded prompts, in rank order, and this rank's rows.

    Gathered over every training rank (``all_gather_object`` sizes each rank's rows first, so
    ranks of unequal row or prompt lengths do not hang), on the CPU; the group is the ranks
    ``[g * size, (g + 1) * size)``, vLLM's groups under ``external_launcher``.
    """
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (prompt_ids.cpu(), prompt_mask.cpu()))
    first = rank - rank % size
    group = everyone[first : first + size]
    width = max(ids.shape[1] for ids, _ in group)
    ids = torch.cat([nn.functional.pad(i, (width - i.shape[1], 0)) for i, _ in group])
    mask = torch.cat([nn.functional.pad(m, (width - m.shape[1], 0)) for _, m in group])
    before = sum(len(i) for i, _ in everyone[first:rank])
    return ids, mask, slice(before, before + len(prompt_ids))


def _cpu_kv_cache_bytes(share: float, device_type: str) -> int | None:
    """On a CPU, ``share`` of the machine's RAM, in bytes; elsewhere None (vLLM's own sizing)."""
    if device_type == "cuda":
        return None
    import psutil

    return int(share * psutil.virtual_memory().total)


def _repack_kept_cpu_weights(worker: Any) -> None:
    """On vLLM's CPU backend, pack again the GEMM weights a reload leaves packed from before.

    The CPU backend packs each linear layer's weight for its GEMM kernel after loading. A reload
    packs every layer it loads, but a head tied to the token embedding is not loaded (its
    weight is the embedding's, updated in place), so its packed copy would stay the old one.
    Runs in the worker (``collective_rpc``).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = getattr(worker, "worker", worker).model_runner.get_model()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, Tensor) and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def launcher_arguments(world_size: int, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """The arguments of one vLLM engine in each of ``world_size`` training processes.

    One process: none (vLLM's default, the engine in this process). Several: vLLM's
    ``external_launcher``, which joins the process group the trainer made: each group of
    ``tensor_parallel_size`` contiguous ranks runs one model sharded over its ranks (1: every
    rank samples its own prompts with the full model).
    """
    if world_size == 1:
        return {}
    return {
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": tensor_parallel_size,
    }


def rank_variables(trainer: Any) -> dict[str, str]:
    """The variables vLLM's ``external_launcher`` reads, as ``trainer`` knows them.

    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the
    trainer and its cluster environment, whichever launched the process: Lightning's own
    launcher sets no ``RANK``, srun (``SLURMEnvironment``) none of the five, torchrun
    (``TorchElasticEnvironment``) all of them; a variable left from another launch must not win.
    """
    values = {
        "RANK": str(trainer.global_rank),
        "LOCAL_RANK": str(trainer.local_rank),
        "WORLD_SIZE": str(trainer.world_size),
    }
    cluster = getattr(trainer.strategy, "cluster_environment", None)
    if cluster is not None:
        values.update(MASTER_ADDR=str(cluster.main_address), MASTER_PORT=str(cluster.main_port))
    return values


def set_rank_variables(trainer: Any) -> None:
    """Set :func:`rank_variables` in this process's environment, before vLLM reads them."""
    os.environ.update(rank_variables(trainer))


def quiet_vllm_logs(global_rank: int) -> None:
    """Keep vLLM's log lines to rank 0: the other ranks log its errors only.

    Every rank's engine logs the same start-up and push lines; one copy is enough.
    """
    import_vllm()  # vLLM configures its logger when imported
    if global_rank != 0:
        logging.getLogger("vllm").setLevel(logging.ERROR)


_ENGINE: dict[str, Any] = {"key": None, "engine": None, "dir": None}


def shared_engine(
    policy: nn.Module,
    *,
    max_model_len: int,
    dtype: str,
    gpu_memory_utilization: float,
    sleep_mode: bool,
    device_type: str,
    world_size: int = 1,
    tensor_parallel_size: int = 1,
) -> VLLMEngine:
    """This process's engine for ``policy``'s architecture and these settings.

    vLLM holds one engine per process comfortably; a second module with the same
    architecture and settings (a test, a second fit) reuses it. Other settings replace it.

    Raises:
        ValueError: If the policy has no Hugging Face config.
    """
    config = getattr(policy, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise ValueError(
            "`engine.kind='vllm'` needs a Hugging Face causal LM as the policy (its config "
            f"builds vLLM's model); got {type(policy).__name__}"
        )
    settings = (max_model_len, dtype, gpu_memory_utilization, sleep_mode, device_type)
    settings += (world_size, tensor_parallel_size)
    key = repr((config.to_json_string(use_diff=False), settings))
    if _ENGINE["key"] != key:
        close_shared_engine()
        folder = tempfile.TemporaryDirectory(prefix="rlkl-vllm-")
        config.save_pretrained(folder.name)
        with random_streams_kept():
            engine = VLLMEngine(
                folder.name,
                max_model_len=max_model_len,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                sleep_mode=sleep_mode,
                device_type=device_type,
                world_size=world_size,
                tensor_parallel_size=tensor_parallel_size,
            )
        _ENGINE.update(key=key, engine=engine, dir=folder)
    return _ENGINE["engine"]


def close_shared_engine() -> None:
    """Shut this process's engine down, if any (its memory is freed once collected)."""
    engine, folder = _ENGINE["engine"], _ENGINE["dir"]
    _ENGINE.update(key=None, engine=None, dir=None)
    if engine is not None:
        shutdown = getattr(engine.llm.llm_engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del engine
        import gc

        gc.collect()
    if folder is not None:
        folder.cleanup()


def engine_trajectory(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    sampler_logprobs: Tensor,
    eos_token_id: int | None,
    pad_token_id: int,
) -> Trajectory:
    """The native loop's trajectory layout around an engine's samples; ``logprobs`` unset.

    ``response_ids`` ``[B, R]`` (on any device) are masked after their first EOS and padded
    there with ``pad_token_id``; the engine's log-probs there are 0.
    """
    device = prompt_ids.device
    response_ids = response_ids.to(device)
    response_mask = response_mask_after_eos(response_ids, eos_token_id)
    response_ids = torch.where(response_mask.bool(), response_ids, pad_token_id)
    attention_mask = torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1).long()
    return Trajectory(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=attention_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        sampler_logprobs=sampler_logprobs.to(device) * response_mask,
    )


def check_vllm_settings(
    engine: Any, device: torch.device, world_size: int, strategy: str = "ddp"
) -> None:
    """Refuse, by name, the settings this engine does not run with.

    Args:
        engine: The ``engine`` options group.
        device: The trainer's device.
        world_size: The training processes.
        strategy: :func:`strategy_name` of the trainer's strategy (several processes run
            under DDP and FSDP only).

    Raises:
        ValueError: ``engine.sleep_mode`` off CUDA; several processes under another strategy
            than DDP or ``FSDPStrategy`` (whose weights the engine is given gathered).
    """
    if engine.sleep_mode and device.type != "cuda":
        raise ValueError(
            f"`engine.sleep_mode`=True frees vLLM's accelerator memory and needs CUDA; this run "
            f"is on {device.type!r}: set `engine.sleep_mode`=False"
        )
    if world_size > 1 and strategy not in ("ddp", "fsdp"):
        raise ValueError(
            f"`engine.kind='vllm'` runs in one process, under DDP or under FSDPStrategy (one "
            f"engine per rank); this run has {world_size} processes under {strategy}, whose "
            "weights the engine cannot be given yet: use `trainer.strategy=ddp` or "
            "`trainer.strategy=fsdp`, or `engine.kind='native'`"
        )


#: The sampling options the engine is given per request.
ENGINE_SAMPLING = ("temperature", "top_k", "top_p", "max_new_tokens")

#: Distinct numbers for the engines of one process (whose weights the shared ``LLM`` holds).
_engines = itertools.count()


def engine_dtype(module: Any) -> str:
    """The engine's dtype: the trainer's precision (without a trainer, the policy's).

    Raises:
        ValueError: For a precision vLLM does not run with, naming the allowed ones.
    """
    if module._trainer is not None:
        precision = str(module.trainer.precision)
        if precision not in PRECISION_DTYPES:
            raise ValueError(
                f"{module.owner}: `engine.kind='vllm'` runs with precision "
                f"{sorted(PRECISION_DTYPES)}, got {precision!r}"
            )
        return PRECISION_DTYPES[precision]
    dtype = next(module.policy.parameters()).dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def strategy_name(trainer: Any) -> str:
    """``ddp`` for DDP (or no trainer), ``fsdp`` for ``FSDPStrategy``, else the class name."""
    if trainer is None:
        return "ddp"
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy | SingleDeviceStrategy):
        return "ddp"
    if isinstance(strategy, FSDPStrategy):
        return "fsdp"
    return type(strategy).__name__


@ENGINES.register("vllm")
class VLLMRolloutEngine(RolloutEngine):
    """vLLM samples, the trainer's weights pushed into it; the policy scores its samples.

    The trajectory has the native loop's layout; ``sampler_logprobs`` are the engine's
    log-probs, ``logprobs`` the trainer's (those enter ratios and the KL), and the scores
    (logits, hidden states) are the policy's, as the native loop keeps them.

    Args:
        tensor_parallel_size: Training ranks per vLLM model (contiguous ranks, sharded over
            them, the group's prompts gathered and sampled together); it must divide the
            world size (:func:`check_tensor_parallel`). 1: one whole engine per rank.

    Raises:
        ValueError: For a ``tensor_parallel_size`` that is not an integer >= 1.
    """

    shares_weights: ClassVar[bool] = False

    def __init__(self, tensor_parallel_size: int = 1) -> None:
        size = tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                "`engine.kind.init_args.tensor_parallel_size` must be an integer >= 1, "
                f"got {size!r}"
            )
        self.tensor_parallel_size = size
        self.number = next(_engines)
        #: This process's ``LLM`` (:func:`shared_engine`), once started.
        self.llm_engine: VLLMEngine | None = None

    def start(self, module: Any) -> None:
        """Check the settings and build (or reuse) this process's ``LLM`` for the policy.

        Under DDP and FSDP every rank builds its own engine here, at the same hook (vLLM's
        start-up is a collective: it agrees on the KV-cache memory over the ranks), after the
        rank variables vLLM reads are set from the trainer.
        """
        trainer = module._trainer
        world_size = trainer.world_size if trainer is not None else 1
        strategy = strategy_name(trainer)
        check_vllm_settings(module.engine, module.device, world_size, strategy)
        check_tensor_parallel(self.tensor_parallel_size, world_size)
        dtype = engine_dtype(module)  # a precision vLLM cannot run with stops here
        if self.llm_engine is not None:  # started, and not closed since
            return
        if world_size > 1:
            set_rank_variables(trainer)
            quiet_vllm_logs(trainer.global_rank)
        hp = module.sampling
        self.llm_engine = shared_engine(
            module.policy,
            max_model_len=hp.max_prompt_tokens + hp.max_new_tokens,
            dtype=dtype,
            gpu_memory_utilization=module.engine.gpu_memory_utilization,
            sleep_mode=module.engine.sleep_mode,
            device_type=module.device.type,
            world_size=world_size,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def push(self, module: Any) -> None:
        """Push the policy's weights if the ``LLM`` holds others (another version or module).

        Under FSDP every rank gathers the weights here, unit by unit (:func:`engine_weights`):
        the ranks decide alike, since their weights versions are equal.
        """
        if self.llm_engine is None:
            self.start(module)
        engine = self.llm_engine
        owner = (self.number, module.weights_version)
        if engine.push_enabled and engine.weights_of != owner:
            engine.push(engine_weights(module.policy), owner)

    def sample(
        self, module: Any, prompt_ids: Tensor, prompt_mask: Tensor, keep_logits: bool
    ) -> tuple[Trajectory, TokenScores]:
        """The engine's samples, one seeded request per row; then the policy's scores of them.

        With ``tensor_parallel_size`` > 1 the group's ranks sample their gathered prompts
        together (the same requests, the same seeds) and each keeps its own rows.
        """
        if self.llm_engine is None:
            self.start(module)
        hp, tokenizer = module.sampling, module.tokenizer
        batch = module.batches_seen + module.skipped_batches  # both restored on a resume
        size, rank = self.tensor_parallel_size, module.global_rank
        ids, mask, rows = prompt_ids, prompt_mask, slice(None)
        if size > 1:
            ids, mask, rows = group_prompts(prompt_ids, prompt_mask, rank, size)
        seeds = group_seeds(run_seed(), batch, rank // size, len(ids))
        eos = tokenizer.eos_token_id if hp.stop_at_eos else None
        pad = tokenizer.pad_token_id
        sampling = {name: getattr(hp, name) for name in ENGINE_SAMPLING}
        response_ids, sampler_logprobs = self.llm_engine.sample(
            ids, mask, seeds, sampling, eos, pad, rows
        )
        traj = engine_trajectory(prompt_ids, prompt_mask, response_ids, sampler_logprobs, eos, pad)
        policy = module.policy
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad():
                scores = score_tokens(policy, traj, hp.temperature, logits=keep_logits)
        finally:
            policy.train(was_training)
        return traj._replace(logprobs=scores.logprobs), scores

    def close(self) -> None:
        """Let go of the ``LLM``; the process keeps it for the next module with its settings.

        :func:`close_shared_engine` shuts it down.
        """
        self.llm_engine = None
