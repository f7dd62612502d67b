"""Benchmark workers: one process per library, paced one PPO iteration at a time.

A worker loads its library, builds its trainer on the benchmark world and starts training.
Before every iteration it blocks until the parent writes ``go`` on its stdin; after the
iteration it writes one JSON line (wall time, phase split, max RSS, peak GPU memory) to the
result pipe. So the parent can alternate the libraries iteration by iteration while only one
of them runs. Phase boundaries wait for the device (``torch.cuda.synchronize`` on a GPU), so
each phase's time is the time of its own work.

Run by ``ppo_throughput.py`` (sides ``ours``, ``ours_separate_value``, ``trl``: PPO) and
``grpo_throughput.py`` (sides ``ours_grpo``, ``trl_grpo``): ``python workers.py SIDE WORLD_DIR
RESULT_FD ITERATIONS SETTINGS`` (``SETTINGS``: JSON with ``preset``, ``tiny``, ``device``,
``precision``, ``threads``, ``cpu_matmul``; GRPO adds ``generations``). With ``ragged`` in the
settings our sides' responses are ragged (:func:`cut_responses`) and each iteration's report
counts the update's token positions; a side named ``..._packed`` sets
``optimization.packing="packed"``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

TEMPERATURE, KL_COEF, LR, SEED = 0.7, 0.05, 3e-6, 0


class StepCounter:
    """Counts optimizer steps of every torch optimizer in this process (a global step hook)."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.steps = 0
        register_optimizer_step_post_hook(self._count)

    def _count(self, optimizer, args, kwargs) -> None:
        self.steps += 1

    def take(self) -> int:
        """Steps since the last call."""
        steps, self.steps = self.steps, 0
        return steps


class Pacer:
    """Blocks before each iteration until told to go; reports each iteration's timings."""

    def __init__(self, fd: int, device: str):
        import torch

        self.out = os.fdopen(fd, "w", buffering=1)
        self.start = 0.0
        self.counter = StepCounter()
        self.info: dict = {}
        self.cuda = device == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)

    def send(self, **message) -> None:
        """Write one JSON line to the parent."""
        self.out.write(json.dumps(message) + "\n")

    def wait(self) -> None:
        """Wait for ``go`` from the parent; the iteration clock starts when it arrives."""
        line = sys.stdin.readline().strip()
        if line != "go":
            raise SystemExit(0)
        self.counter.take()
        self.sync()
        self.start = time.perf_counter()

    def done(self, **phases: float) -> None:
        """Report the iteration that just ended."""
        self.sync()
        seconds = time.perf_counter() - self.start
        # The process's peaks, which the module's per-phase resets do not lower.
        from rlkl_lightning.algorithms.memory import process_peak_bytes

        rss = process_peak_bytes("cpu") / 2**20
        steps = self.counter.take()
        gpu = {}
        if self.cuda:
            gpu["max_gpu_mib"] = process_peak_bytes("cuda", "allocated") / 2**20
        self.send(
            seconds=seconds, max_rss_mib=rss, optimizer_steps=steps, **gpu, **self.info, **phases
        )

    def timed(self, marks: dict, start: str | None, end: str | None, fn):
        """``fn`` with the device-synchronised clock written to ``marks[start]``/``[end]``."""

        def wrapper(*args, **kwargs):
            if start is not None:
                self.sync()
                marks.setdefault(start, time.perf_counter())
            out = fn(*args, **kwargs)
            if end is not None:
                self.sync()
                marks[end] = time.perf_counter()
            return out

        return wrapper


def describe_optimizer(optimizer) -> dict:
    """What the worker reports about its optimizer (to check both sides run the same one)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning / accelerate wrappers
    return {"optimizer": f"{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})"}


class SpacedPairReward:
    """The reward classifier on ``prompt + " " + response``.

    The benchmark tokenizer is word level and decodes a response without a leading space, so
    the plain concatenation would glue the last prompt word to the first response word; with
    the space the classifier sees the same tokens that TRL gives its reward model.
    """

    def __init__(self, classifier):
        self.classifier = classifier

    def __call__(self, prompts: list[str], responses: list[str]):
        """Scores ``[B]``."""
        return self.classifier(prompts, [" " + r for r in responses])

    def to(self, device):
        """Move the classifier."""
        self.classifier.to(device)
        return self


def lightning_trainer(settings: dict, callbacks=()):
    """The Trainer of our sides: one device, one epoch, no logging, checkpoints or validation."""
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="gpu" if settings["device"] == "cuda" else "cpu",
        devices=1,
        precision=settings["precision"],
        max_epochs=1,
        logger=False,
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def _our_options(world: Path, settings: dict, p) -> tuple[dict, object]:
    """What both of our sides set alike: ``(keyword arguments, reward model)``.

    The option groups are dicts, so that a side adds its own fields to them.
    """
    from lightning.pytorch import seed_everything

    from rlkl_lightning.rewards import SequenceClassifierReward

    seed_everything(SEED, verbose=False)
    # None: the library's default for the option (what a user gets without setting it)
    matmul = {} if settings["cpu_matmul"] is None else {"cpu_matmul": settings["cpu_matmul"]}
    reward = SequenceClassifierReward(
        str(world / "reward"),
        label=0,
        tokenizer=str(world / "tokenizer"),
        text="prompt+response",
        batch_size=p.batch,
        **matmul,
    )
    options = dict(
        policy=str(world / "policy"),
        tokenizer=str(world / "tokenizer"),
        penalty={"init_coef": KL_COEF},
        sampling={
            "max_new_tokens": p.response,
            "temperature": TEMPERATURE,
            "stop_at_eos": bool(settings.get("ragged")),
        },
        optimization={
            "ppo_epochs": p.epochs,
            "num_minibatches": p.minibatches,
            "lr": LR,
            "packing": settings.get("packing", "none"),
            "compile": settings.get("compile", False),
        },
        engine={"compiled_decode": settings.get("compiled_decode", False)},
        logging={"log_samples_every": 0},
        models=matmul,
    )
    return options, reward


def ours(world: Path, settings: dict, separate_value: bool, iterations: int, callbacks=()):
    """Our side: ``(trainer, module, data)``, PPOModule on the world as both sides configure it."""
    from bench_world import preset, prompts
    from torch.utils.data import DataLoader

    from rlkl_lightning import PPOModule

    p = preset(settings["preset"], settings["tiny"], settings.get("batch"))
    options, reward = _our_options(world, settings, p)
    options["penalty"]["estimator"] = "k1"
    options["sampling"]["max_prompt_tokens"] = p.prompt
    module = PPOModule(
        ppo={
            "value_model": str(world / "policy") if separate_value else None,
            "value_model_thread": settings.get("value_model_thread") if separate_value else None,
        },
        reward=SpacedPairReward(reward),
        **options,
    )
    data = DataLoader(
        prompts(p, p.batch * iterations), batch_size=p.batch, collate_fn=lambda xs: {"prompt": xs}
    )
    return lightning_trainer(settings, callbacks), module, data


def cut_responses(traj, generator, pad_token_id: int):
    """``traj`` with each response ended after a drawn number of tokens, uniform in 1..R.

    The benchmark world's policy has random weights and almost never samples EOS: this gives
    its responses the lengths an EOS stop gives (the response mask, the attention mask and the
    pad tokens after the end as the rollout leaves them), drawn with a fixed seed so that every
    side trains on responses of the same lengths. The kept tokens and their log-probs are those
    sampled.
    """
    import torch

    rows, steps = traj.response_ids.shape
    lengths = torch.randint(1, steps + 1, (rows, 1), generator=generator)
    kept = torch.arange(steps) < lengths
    mask = traj.response_mask * kept.to(traj.response_mask.device, traj.response_mask.dtype)
    valid = mask.bool()
    response = torch.where(
        valid, traj.response_ids, torch.full_like(traj.response_ids, pad_token_id)
    )
    prompt = traj.input_ids.shape[1] - steps
    return traj._replace(
        input_ids=torch.cat([traj.input_ids[:, :prompt], response], 1),
        attention_mask=torch.cat([traj.attention_mask[:, :prompt], valid.long()], 1),
        response_ids=response,
        response_mask=mask,
        logprobs=traj.logprobs * mask,
    )


def count_positions(module, marks: dict) -> None:
    """Count the update's token positions per iteration in ``marks``: padded, real and packed.

    ``padded``: the padded rows' ``b x (P + R)`` of every loss pass; ``real``: the tokens a
    packed pass forwards of them; ``packed``: the packed rows' ``n x L`` (packing on).
    """
    from rlkl_lightning.models.packing import kept_tokens

    loss, packed_rows = module.loss, module.policy_objective.packed_rows

    def counted_loss(minibatch):
        marks["padded_positions"] = marks.get("padded_positions", 0) + minibatch.input_ids.numel()
        real = int(kept_tokens(minibatch.attention_mask, minibatch.response_mask).sum())
        marks["real_positions"] = marks.get("real_positions", 0) + real
        return loss(minibatch)

    def counted_rows(model, minibatch):
        rows = packed_rows(model, minibatch)
        if rows is not None and model is module.policy:
            marks["packed_positions"] = marks.get("packed_positions", 0) + rows.positions
        return rows

    module.loss = counted_loss
    module.policy_objective.packed_rows = counted_rows


def run_ours(pacer: Pacer, iterations: int, settings: dict, build) -> None:
    """Our module's real training_step under a Lightning Trainer, one batch per iteration.

    ``build(callbacks)`` returns ``(trainer, module, data)``: :func:`ours` or :func:`ours_grpo`.
    """
    import torch
    from lightning.pytorch import Callback

    marks: dict[str, float] = {}

    class Pace(Callback):
        def on_train_start(self, trainer, pl_module):
            pacer.info = describe_optimizer(trainer.optimizers[0])
            pacer.wait()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            positions = {k: v for k, v in marks.items() if k.endswith("_positions")}
            pacer.done(
                rollout=marks["rollout_end"] - pacer.start,
                score=marks["update_start"] - marks["rollout_end"],
                update=marks["update_end"] - marks["update_start"],
                sampled_tokens=marks["tokens"],
                **positions,
            )
            marks.clear()
            if batch_idx + 1 < iterations:
                pacer.wait()

    trainer, module, data = build([Pace()])
    rollout = pacer.timed(marks, None, "rollout_end", module.rollout)

    generator = torch.Generator().manual_seed(SEED)

    def counted_rollout(prompts):
        traj, scores = rollout(prompts)
        if settings.get("ragged"):
            traj = cut_responses(traj, generator, module.tokenizer.pad_token_id)
        marks["tokens"] = int(traj.response_mask.sum())
        return traj, scores

    module.rollout = counted_rollout
    if settings.get("ragged"):
        count_positions(module, marks)
    module.update = pacer.timed(marks, "update_start", "update_end", module.update)
    torch.set_num_threads(settings["threads"])
    pacer.send(ready=True)
    trainer.fit(module, data)


def run_trl(world: Path, pacer: Pacer, iterations: int, settings: dict) -> None:
    """TRL's PPOTrainer.train() on the same world and the same work per iteration."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import tempfile

    import torch
    from bench_world import preset, prompts
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
        set_seed,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    p = preset(settings["preset"], settings["tiny"], settings.get("batch"))
    set_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer")
    ids = tokenizer(prompts(p, p.batch * iterations))["input_ids"]
    dataset = Dataset.from_dict({"input_ids": ids})
    policy = AutoModelForCausalLM.from_pretrained(world / "policy")
    reference = AutoModelForCausalLM.from_pretrained(world / "policy")
    reward = AutoModelForSequenceClassification.from_pretrained(world / "reward")
    value = AutoModelForSequenceClassification.from_pretrained(world / "value")
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=p.batch,  # with 1 accumulation step: p.batch prompts per iter
        gradient_accumulation_steps=1,  # so every minibatch is one optimizer step (16 per iter)
        num_mini_batches=p.minibatches,
        num_ppo_epochs=p.epochs,
        local_rollout_forward_batch_size=p.batch,  # one generation / scoring batch
        total_episodes=p.batch * iterations,
        response_length=p.response,
        temperature=TEMPERATURE,
        stop_token=None,  # exactly p.response new tokens, like stop_at_eos=False on our side
        missing_eos_penalty=None,
        kl_coef=KL_COEF,
        kl_estimator="k1",
        learning_rate=LR,
        num_sample_generations=0,  # no extra sampling for logs
        bf16=settings["precision"] == "bf16-mixed",  # TRL's own mixed precision
        fp16=False,
        gradient_checkpointing=False,  # TRL's default recomputes activations: off, it only slows
        use_cpu=settings["device"] == "cpu",
        seed=SEED,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    marks: dict[str, float] = {}
    forward = trl_ppo.forward

    def timed_forward(model, *args, **kwargs):
        # The update loop forwards the policy+value wrapper; scoring forwards the reference.
        if isinstance(model, trl_ppo.PolicyAndValueWrapper) and "update_start" not in marks:
            pacer.sync()
            marks["update_start"] = time.perf_counter()
        return forward(model, *args, **kwargs)

    trl_ppo.batch_generation = pacer.timed(marks, None, "rollout_end", trl_ppo.batch_generation)
    trl_ppo.forward = timed_forward

    class Pace(TrainerCallback):
        def __init__(self):
            self.steps = 0

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            pacer.info = describe_optimizer(optimizer)
            pacer.wait()

        def on_step_end(self, args, state, control, **kwargs):
            pacer.sync()
            end = time.perf_counter()
            pacer.done(
                rollout=marks["rollout_end"] - pacer.start,
                score=marks["update_start"] - marks["rollout_end"],
                update=end - marks["update_start"],
            )
            marks.clear()
            self.steps += 1
            if self.steps < iterations:
                pacer.wait()

    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        callbacks=[Pace()],
    )
    torch.set_num_threads(settings["threads"])
    pacer.send(ready=True)
    trainer.train()


def grpo_prompts(p, iterations: int, generations: int) -> list[str]:
    """The prompts of ``iterations`` GRPO batches: ``p.batch // generations`` prompts each.

    Every prompt ends with a space: TRL scores ``prompt + completion`` and our side scores
    ``prompt + " " + response``, so both reward models see the same word tokens.
    """
    from bench_world import prompts

    return [x + " " for x in prompts(p, p.batch // generations * iterations)]


def ours_grpo(world: Path, settings: dict, iterations: int, callbacks=()):
    """Our GRPO side: ``(trainer, module, data)``, RLOOModule as TRL's GRPOTrainer's work."""
    from bench_world import preset
    from torch.utils.data import DataLoader

    from rlkl_lightning import RLOOModule

    p = preset(settings["preset"], settings["tiny"], settings.get("batch"))
    k = settings["generations"]
    options, reward = _our_options(world, settings, p)
    options["penalty"].update(placement="loss", loss_estimator="k3")
    options["sampling"]["max_prompt_tokens"] = p.prompt + 1
    module = RLOOModule(
        reward=reward,
        group={"responses_per_prompt": k, "advantage": "grpo", "scale_rewards": "group"},
        # TRL's bnpo: tokens of the local minibatch
        objective={"aggregation": "batch_token_mean", "cliprange": 0.2},
        **options,
    )
    # p.batch // k prompts per batch; RLOOModule repeats each k times in a row.
    data = DataLoader(
        grpo_prompts(p, iterations, k),
        batch_size=p.batch // k,
        collate_fn=lambda xs: {"prompt": xs},
    )
    return lightning_trainer(settings, callbacks), module, data


def run_trl_grpo(world: Path, pacer: Pacer, iterations: int, settings: dict) -> None:
    """TRL's GRPOTrainer.train() with transformers' ``generate`` (no vLLM), the same work."""
    import tempfile

    import torch
    from bench_world import preset
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
        set_seed,
    )
    from trl import GRPOConfig, GRPOTrainer

    p = preset(settings["preset"], settings["tiny"], settings.get("batch"))
    k = settings["generations"]
    steps = p.epochs * p.minibatches  # optimizer steps per generation
    set_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer")
    dataset = Dataset.from_dict({"prompt": grpo_prompts(p, iterations, k)})
    bf16 = settings["precision"] == "bf16-mixed"
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-bench-"),
        per_device_train_batch_size=p.batch // p.minibatches,  # completions per optimizer step
        gradient_accumulation_steps=1,
        steps_per_generation=p.minibatches,  # so one generation = p.batch completions
        num_generations=k,
        num_iterations=p.epochs,
        max_completion_length=p.response,
        # exactly p.response tokens, like stop_at_eos=False on our side: EOS is never sampled
        generation_kwargs={"min_new_tokens": p.response},
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=KL_COEF,
        use_bias_correction_kl=False,
        loss_type="bnpo",
        scale_rewards="group",
        epsilon=0.2,
        learning_rate=LR,
        max_steps=steps * iterations,
        bf16=bf16,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=settings["device"] == "cpu",
        use_vllm=False,
        seed=SEED,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=steps,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    policy = AutoModelForCausalLM.from_pretrained(world / "policy")
    reward = AutoModelForSequenceClassification.from_pretrained(world / "reward")
    marks: dict[str, float] = {}

    class Pace(TrainerCallback):
        def __init__(self):
            self.steps = 0

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            pacer.info = describe_optimizer(optimizer)
            pacer.wait()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1
            if self.steps % steps:
                return
            pacer.sync()
            end = time.perf_counter()
            pacer.done(
                rollout=marks["rollout_end"] - pacer.start,
                score=marks["update_start"] - marks["rollout_end"],
                update=end - marks["update_start"],
                sampled_tokens=marks["tokens"],
            )
            marks.clear()
            if self.steps < steps * iterations:
                pacer.wait()

    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_processing_classes=tokenizer,
        callbacks=[Pace()],
    )
    generate = pacer.timed(marks, None, "rollout_end", trainer._generate)
    score = pacer.timed(marks, None, "update_start", trainer._generate_and_score_completions)

    def counted_score(inputs):
        out = score(inputs)
        marks["tokens"] = int(out["completion_mask"].sum())
        return out

    trainer._generate = generate
    trainer._generate_and_score_completions = counted_score
    torch.set_num_threads(settings["threads"])
    pacer.send(ready=True)
    trainer.train()


def main() -> None:
    side, world, fd, iterations = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    settings = json.loads(sys.argv[5])
    if side.endswith("_packed"):  # our side again, packing on
        side, settings = side.removesuffix("_packed"), {**settings, "packing": "packed"}
    compiled = side.endswith("_compiled")  # our side again, with the compiled options asked
    side = side.removesuffix("_compiled")
    settings = {
        **settings,
        "compile": compiled and settings.get("compiled_update", True),
        "compiled_decode": compiled and settings.get("compiled_decode", False),
    }
    sys.path.insert(0, str(Path(__file__).parent))
    import torch

    torch.set_num_threads(settings["threads"])
    pacer = Pacer(fd, settings["device"])
    if side == "trl":
        run_trl(world, pacer, iterations, settings)
    elif side == "trl_grpo":
        run_trl_grpo(world, pacer, iterations, settings)
    elif side == "ours_grpo":
        run_ours(pacer, iterations, settings, partial(ours_grpo, world, settings, iterations))
    else:
        separate = side == "ours_separate_value"
        run_ours(pacer, iterations, settings, partial(ours, world, settings, separate, iterations))


if __name__ == "__main__":
    main()
