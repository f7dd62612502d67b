"""The exact world: a response space small enough to list, so every quantity is exact.

A tiny GPT-2 over ``V`` word tokens answers one fixed prompt with exactly ``L`` tokens, so its
responses are the ``V^L`` sequences of ``L`` tokens (a few thousand at most). The reward is a
seeded table on those sequences (one score per token id sequence). With them the optimum of the
KL-regularised objective is known in closed form (:mod:`rlkl_lightning.kl.optimum`): ``pi*``,
its KL and reward at any beta, the beta of a KL target, the reward-KL frontier; and a trained
policy's KL to the reference, its expected reward and its KL to ``pi*`` are sums over all
responses of its sequence log-probabilities, computed in one batched forward pass.

The vocabulary holds only plain words; the tokenizer's special tokens (pad, eos) have ids
beyond the model's vocabulary, so the model can never emit one, decoding a response loses
nothing, and the responses run to ``max_new_tokens`` (the training configs set
``stop_at_eos: false``). The pipeline's reward interface takes text, so :class:`TableReward`
maps each decoded response back to its token ids (a bijection) and looks it up.

``policy: exact`` in a training config names the standard world's model directory, built on
first use in a second (:func:`exact_model_dir`); :class:`TableReward` and
:class:`ExactMetrics` build the same world from the same settings.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl import optimum as opt
from rlkl_lightning.kl.estimators import Estimator, kl_estimator
from rlkl_lightning.world.cache import default_cache_dir

#: The words of the vocabulary, in id order; the first ``vocab_size`` are used.
WORDS = ("a", "b", "c", "d", "e", "f", "g", "h")
PAD, EOS = "<pad>", "<eos>"
_FORMAT = 1  # bump when the files a build writes change


@dataclass(frozen=True)
class ExactWorldConfig:
    """The settings that make an exact world (the same settings, the same world, bit for bit).

    Args:
        vocab_size: ``V``, word tokens (2 to 8).
        length: ``L``, tokens per response; ``V^L`` responses, at most 4096.
        seed: Seed of the reference's weights and of the reward table.
        prompt: The one prompt: a single word of the vocabulary.
        n_embd: Width of the GPT-2.
        n_layer: Its layers.
        init_scale: Standard deviation of its initial weights (GPT-2's is 0.02, which leaves
            every next-token distribution almost uniform; larger makes the reference uneven
            and its tokens depend on their prefix).
        reward_scale: Standard deviation of the reward's per-token and per-pair terms.
    """

    vocab_size: int = 6
    length: int = 4
    seed: int = 0
    prompt: str = "a"
    n_embd: int = 16
    n_layer: int = 1
    init_scale: float = 0.5
    reward_scale: float = 0.5

    def __post_init__(self) -> None:
        v, n = self.vocab_size, self.length
        if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= len(WORDS):
            raise ValueError(f"exact world: `vocab_size` must be an integer in [2, 8], got {v!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"exact world: `length` must be an integer >= 1, got {n!r}")
        if v**n > 4096:
            raise ValueError(
                f"exact world: `vocab_size`^`length` must be <= 4096 responses, got {v}^{n} = "
                f"{v**n}; lower `length` or `vocab_size`"
            )
        if self.prompt not in WORDS[:v]:
            raise ValueError(
                f"exact world: `prompt` must be one of {list(WORDS[:v])}, got {self.prompt!r}"
            )
        for name in ("init_scale", "reward_scale"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(
                    f"exact world: `{name}` must be a finite number > 0, got {value!r}"
                )

    @property
    def words(self) -> tuple[str, ...]:
        """The vocabulary, in id order."""
        return WORDS[: self.vocab_size]

    @property
    def name(self) -> str:
        """The cache directory's name: every setting in it."""
        return (
            f"exact-f{_FORMAT}-v{self.vocab_size}-l{self.length}-s{self.seed}-p{self.prompt}"
            f"-e{self.n_embd}-n{self.n_layer}-i{self.init_scale:g}-r{self.reward_scale:g}"
        )


def all_responses(vocab_size: int, length: int) -> Tensor:
    """Every response: ``[V^L, L]`` token ids in lexicographic order."""
    return torch.tensor(list(itertools.product(range(vocab_size), repeat=length)))


def reward_table(config: ExactWorldConfig) -> Tensor:
    """``[V^L]`` float64 rewards: a seeded score per token plus one per pair of neighbours.

    ``R(y) = sum_t u[t, y_t] + sum_{t>0} w[y_{t-1}, y_t]``: the pair terms make the optimum's
    tokens depend on their prefix, where a per-token KL gradient differs from the sequence one.
    """
    v, n = config.vocab_size, config.length
    gen = torch.Generator().manual_seed(10_007 + config.seed)
    u = torch.randn(n, v, generator=gen, dtype=torch.float64) * config.reward_scale
    w = torch.randn(v, v, generator=gen, dtype=torch.float64) * config.reward_scale
    ys = all_responses(v, n)
    rewards = u[torch.arange(n), ys].sum(-1)
    if n > 1:
        rewards = rewards + w[ys[:, :-1], ys[:, 1:]].sum(-1)
    return rewards


def make_tokenizer(config: ExactWorldConfig):
    """A word-level tokenizer: the words at ids ``0 .. V-1``, pad and eos after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate((*config.words, PAD, EOS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        padding_side="left",
        model_max_length=1 + config.length,
    )


def make_reference(config: ExactWorldConfig):
    """The reference GPT-2: seeded random float32 weights of scale ``init_scale``, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model_config = GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=1 + config.length,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=2,
        initializer_range=config.init_scale,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # the tokenizer's pad and eos lie beyond the vocabulary
        eos_token_id=None,
        pad_token_id=None,
    )
    # In float32 whatever the default dtype (Lightning's 64-true sets it while a module is
    # built, which may build the world first): another dtype draws other weights.
    dtype = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        torch.set_default_dtype(torch.float32)
        try:
            return GPT2LMHeadModel(model_config).eval()
        finally:
            torch.set_default_dtype(dtype)


def build_exact_world(config: ExactWorldConfig | None = None, root: Path | None = None) -> Path:
    """The world's model directory (tokenizer and reference), built if missing; its path.

    Built in a temporary directory and renamed into place when complete, so a reader never
    sees half a world; two processes that build at once both end with the same directory.
    """
    config = config or ExactWorldConfig()
    root = Path(root) if root is not None else default_cache_dir()
    path = root / config.name
    if (path / "config.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{config.name}-", dir=root))
    try:
        make_reference(config).save_pretrained(tmp)
        make_tokenizer(config).save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished first
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def exact_model_dir() -> Path:
    """The standard exact world's model directory (``policy: exact``), built on first use."""
    return build_exact_world(ExactWorldConfig())


def sequence_logprobs(
    model: torch.nn.Module, prompt_ids: Tensor, responses: Tensor, temperature: float = 1.0
) -> Tensor:
    """``[N]`` float64 ``log pi(y | x)`` of every response, in one batched forward pass.

    Args:
        model: A causal LM whose vocabulary holds the responses' ids.
        prompt_ids: ``[P]`` the prompt's token ids.
        responses: ``[N, L]`` response token ids.
        temperature: The sampling temperature the log-probabilities are taken at.
    """
    device = next(model.parameters()).device
    n, length = responses.shape
    prompt_len = prompt_ids.numel()
    ids = torch.cat([prompt_ids.expand(n, prompt_len), responses], dim=1).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, prompt_len - 1 : prompt_len - 1 + length]
    finally:
        model.train(was_training)
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, responses.to(device)[..., None]).squeeze(-1).sum(-1).cpu()


class ExactWorld:
    """The enumerated world: every response, the reference's and the reward's value of each.

    Args:
        config: The world's settings (None: the standard world).
        root: The cache directory (None: the default cache).
    """

    def __init__(self, config: ExactWorldConfig | None = None, root: Path | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config or ExactWorldConfig()
        self.model_dir = build_exact_world(self.config, root)
        self.responses = all_responses(self.config.vocab_size, self.config.length)
        self.prompt_ids = torch.tensor([self.config.words.index(self.config.prompt)])
        self.rewards = reward_table(self.config)
        reference = AutoModelForCausalLM.from_pretrained(self.model_dir, weights_only=True)
        self.ref_logprobs = sequence_logprobs(reference, self.prompt_ids, self.responses)

    def reference_table(self) -> Tensor:
        """``[P, V]`` float64: the reference's next-token log-probabilities after each prefix.

        Every prefix shorter than ``L``, numbered as :func:`prefix_rows` does.
        """
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(self.model_dir, weights_only=True)
        n, length = self.responses.shape
        ids = torch.cat([self.prompt_ids.expand(n, 1), self.responses], dim=1)
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[:, :length].double()
        logp = torch.log_softmax(logits, -1)  # [N, L, V]
        rows = prefix_rows(self.responses, self.config.vocab_size)
        table = torch.empty(int(rows.max()) + 1, self.config.vocab_size, dtype=torch.float64)
        table[rows.flatten()] = logp.flatten(0, 1)  # every row of a prefix holds the same values
        return table

    def texts(self) -> list[str]:
        """Every response as the pipeline decodes it (words joined by spaces), in order."""
        words = self.config.words
        return [" ".join(words[i] for i in row) for row in self.responses.tolist()]

    def optimum(self, beta: float) -> opt.Optimum:
        """``pi* ∝ ref exp(R / beta)`` with its KL and reward."""
        return opt.optimum(self.ref_logprobs, self.rewards, beta)

    def beta_for_kl(self, target: float) -> float:
        """The beta whose optimum's KL to the reference is ``target`` nats per sequence."""
        return opt.beta_for_kl(self.ref_logprobs, self.rewards, target)

    def frontier(self, betas: list[float]) -> list[tuple[float, float]]:
        """The exact (KL, expected reward) of the optimum at each beta."""
        return opt.frontier(self.ref_logprobs, self.rewards, betas)

    def frontier_reward(self, kl: float) -> float:
        """The largest expected reward of any policy whose KL to the reference is ``kl``.

        0 KL: the reference's reward; beyond the largest reachable KL, the top reward.
        """
        if kl <= 0:
            return opt.expected(self.ref_logprobs, self.rewards)
        if kl >= opt.max_kl(self.ref_logprobs, self.rewards):
            return float(self.rewards.max())
        return self.optimum(self.beta_for_kl(kl)).reward

    def policy_metrics(self, logprobs: Tensor, beta: float | None) -> dict[str, float]:
        """A policy's exact KL to the reference, expected reward, and (beta > 0) KL to ``pi*``.

        Args:
            logprobs: ``[N]`` the policy's sequence log-probabilities (:meth:`logprobs`).
            beta: The KL coefficient whose optimum is the yardstick; None or 0: none.
        """
        out = {
            "kl_to_ref": opt.kl(logprobs, self.ref_logprobs),
            "reward": opt.expected(logprobs, self.rewards),
        }
        if beta is not None and beta > 0:
            out["kl_to_optimum"] = opt.kl(logprobs, self.optimum(beta).logprobs)
        return out

    def logprobs(self, model: torch.nn.Module, temperature: float = 1.0) -> Tensor:
        """``[N]`` a model's log-probability of every response."""
        return sequence_logprobs(model, self.prompt_ids, self.responses, temperature)


def prefix_rows(responses: Tensor, vocab_size: int) -> Tensor:
    """``[N, L]`` the index of the prefix before each token, among all prefixes of length < L.

    Prefixes are numbered by length, then lexicographically: the empty one is 0, ``(y_0,)`` is
    ``1 + y_0``, and so on; there are ``(V^L - 1) / (V - 1)`` of them.
    """
    n, length = responses.shape
    rows = torch.zeros(n, length, dtype=torch.long)
    offset, code = 0, torch.zeros(n, dtype=torch.long)
    for t in range(length):
        rows[:, t] = offset + code
        offset += vocab_size**t
        code = code * vocab_size + responses[:, t]
    return rows


def placement_end_point(
    world: ExactWorld,
    beta: float,
    placement: str,
    estimator: str | Estimator,
    steps: int = 3000,
    lr: float = 0.05,
    whiten: bool = False,
    scale_kl: bool = False,
) -> Tensor:
    """Where a KL placement's expected gradient leads: ``[N]`` sequence log-probabilities.

    A tabular policy (one row of logits per prefix: any distribution over the responses)
    starts at the reference and follows, by Adam, the exact expected gradient that the
    placement gives on-policy (sums over every response, no sampling, no whitening):

    - ``reward``: ``E[grad log pi(y) (R(y) - beta sum_t k(l_t))]`` with the penalty held fixed,
      as a reward is;
    - ``loss``: ``E[grad log pi(y) R(y)] - beta E[sum_t grad k(l_t)]`` with the samples' weights
      held fixed (``k1``'s second term is 0: pure reward ascent, with no end point).

    With ``whiten``, the first term's advantages (returns minus their mean) are divided by their
    standard deviation ``sigma`` under ``pi``, as PPO whitens its advantages: the same end point
    with the KL in the reward (a scale). With the KL in the loss and ``scale_kl`` (PPO since the
    fix of issue 37), the KL term is divided by ``sigma`` too: the same end point again. Without
    ``scale_kl`` (PPO before it), the KL term weighs ``beta x sigma`` against the raw reward,
    ``sigma`` shrinks as the policy sharpens, and with ``k2`` the policy runs away to the top
    response (docs/exact.md).

    Only ``k1`` in the reward ends at ``pi*`` (docs/kl.md, "Where the KL goes"); the others'
    end points are the yardsticks of where training with them can end at best.

    ``estimator`` is any estimator of the registry with a per-token formula, or a user's own
    by its dotted path (:func:`~rlkl_lightning.kl.estimators.kl_estimator`), that declares the
    placement as a role (``loss=True`` for ``"loss"``); ``exact`` needs logits and is refused.
    """
    if placement not in ("reward", "loss"):
        raise ValueError(
            f"placement_end_point: `placement` must be reward or loss, got {placement!r}"
        )
    found = kl_estimator(estimator, "estimator", role=placement, owner="placement_end_point")
    if found.needs_logits:
        raise ValueError(
            f"placement_end_point: `estimator` {found.name!r} needs the logits; the exact "
            "world enumerates estimators with a per-token formula of the log-ratio"
        )
    v = world.config.vocab_size
    ys = world.responses
    rows = prefix_rows(ys, v)
    ref_table = world.reference_table()
    ref_tokens = ref_table[rows, ys]  # [N, L]
    logits = ref_table.clone().requires_grad_()
    optimizer = torch.optim.Adam([logits], lr=lr)
    for _ in range(steps):
        tokens = torch.log_softmax(logits, -1)[rows, ys]
        logp = tokens.sum(-1)
        weights = logp.exp().detach()
        penalty = found.per_token(tokens, ref_tokens).sum(-1)
        returns = world.rewards
        if placement == "reward":  # held fixed, as a reward is
            returns = returns - beta * penalty.detach()
        advantages = returns - (weights * returns).sum()
        sigma = 1.0
        if whiten:  # PPO's whitening: the advantages divided by their standard deviation
            sigma = (weights * advantages**2).sum().sqrt().clamp_min(1e-12)
        objective = (weights * logp * advantages / sigma).sum()
        if placement == "loss":
            objective = objective - beta * (weights * penalty).sum() / (sigma if scale_kl else 1)
        optimizer.zero_grad()
        (-objective).backward()
        optimizer.step()
    with torch.no_grad():
        return torch.log_softmax(logits, -1)[rows, ys].sum(-1)


class TableReward:
    """The exact world's reward: the table's score of each response's token ids.

    Takes the world's settings (:class:`ExactWorldConfig`'s fields; the defaults are the
    standard world's). A response that is not ``length`` words of the vocabulary raises.
    """

    def __init__(self, **settings: Any) -> None:
        self.config = ExactWorldConfig(**settings)
        self.table = reward_table(self.config).float()
        self._ids = {w: i for i, w in enumerate(self.config.words)}

    def ids(self, response: str) -> list[int]:
        """The token ids of a decoded response."""
        words = response.split()
        if len(words) != self.config.length or any(w not in self._ids for w in words):
            raise ValueError(
                f"TableReward: a response must be {self.config.length} words of "
                f"{list(self.config.words)} (set `stop_at_eos: false` and `max_new_tokens: "
                f"{self.config.length}`), got {response!r}"
            )
        return [self._ids[w] for w in words]

    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        """One score per response (the prompt is the world's one prompt)."""
        v = self.config.vocab_size
        rows = [self.ids(response) for response in responses]
        index = [sum(t * v ** (len(ids) - 1 - k) for k, t in enumerate(ids)) for ids in rows]
        return self.table[torch.tensor(index, dtype=torch.long)]

    def __repr__(self) -> str:
        return f"TableReward({asdict(self.config)})"


def _prompt_batch(prompts: list[str]) -> dict[str, list[str]]:
    return {"prompt": list(prompts)}


class ExactDataModule(LightningDataModule):
    """Batches of the world's one prompt: ``{"prompt": [prompt] * batch_size}``.

    Args:
        batch_size: Prompts per batch (>= 1).
        batches_per_epoch: Batches in one pass of the loader (>= 1).
        prompt: The prompt (the standard world's).
    """

    def __init__(
        self, batch_size: int = 32, batches_per_epoch: int = 50, prompt: str = "a"
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("batches_per_epoch", batches_per_epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"ExactDataModule: `{name}` must be an integer >= 1, got {value!r}"
                )
        self.batch_size = batch_size
        self.batches_per_epoch = batches_per_epoch
        self.prompt = prompt

    @override
    def train_dataloader(self) -> DataLoader:
        """The prompt ``batch_size * batches_per_epoch`` times, in batches."""
        prompts = [self.prompt] * (self.batch_size * self.batches_per_epoch)
        return DataLoader(prompts, batch_size=self.batch_size, collate_fn=_prompt_batch)


class ExactMetrics(Callback):
    """Every ``every`` training batches and after the last, the policy's exact numbers.

    Logs ``exact/kl_to_ref``, ``exact/reward`` and ``exact/kl_to_optimum`` (to ``pi*`` at the
    module's current ``kl_coef``) by listing every response (:class:`ExactWorld`), to the
    trainer's loggers at the batch's index. Works with any module that has a causal LM
    ``policy`` and a ``kl_coef``.

    Args:
        every: Training batches between two evaluations (>= 1).
        beta_attribute: The module attribute that holds beta.
        **settings: The world's settings (:class:`ExactWorldConfig`'s fields).
    """

    def __init__(self, every: int = 10, beta_attribute: str = "kl_coef", **settings: Any) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"ExactMetrics: `every` must be an integer >= 1, got {every!r}")
        self.every = every
        self.beta_attribute = beta_attribute
        self.settings = settings
        self.world: ExactWorld | None = None
        self.batches = 0
        #: ``(batch index, {key: value})`` of every evaluation.
        self.history: list[tuple[int, dict[str, float]]] = []

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        """Enumerate the world once."""
        if self.world is None:
            self.world = ExactWorld(ExactWorldConfig(**self.settings))

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Log the exact numbers every ``every`` batches."""
        self.batches += 1
        if self.batches % self.every == 0:
            self._log(trainer, pl_module)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        """Log the final policy's numbers, unless the last batch already did."""
        if self.batches and self.batches % self.every:
            self._log(trainer, pl_module)

    def measure(self, pl_module) -> dict[str, float]:
        """The module's policy's exact numbers now."""
        # An RLPipeline samples at its `sampling.temperature`; any other module at 1.
        sampling = getattr(pl_module, "sampling", None)
        temperature = float(sampling.temperature) if sampling is not None else 1.0
        logprobs = self.world.logprobs(pl_module.policy, temperature)
        beta = float(getattr(pl_module, self.beta_attribute))
        return self.world.policy_metrics(logprobs, beta)

    def _log(self, trainer, pl_module) -> None:
        names = {
            "kl_to_ref": keys.EXACT_KL_TO_REF,
            "reward": keys.EXACT_REWARD,
            "kl_to_optimum": keys.EXACT_KL_TO_OPTIMUM,
        }
        values = {names[k]: v for k, v in self.measure(pl_module).items()}
        # Straight to the loggers at the batch's index (the step the module's own metrics
        # have): through `pl_module.log` the values would be logged again, stale, every batch.
        step = getattr(pl_module, "batches_seen", self.batches) - 1
        self.history.append((step, values))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)
