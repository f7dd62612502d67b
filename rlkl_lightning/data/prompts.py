"""Prompts and held-out text for PPO.

A source is a registered name (:mod:`.sources`), such as ``"default"``, the offline default
world (:mod:`rlkl_lightning.world` registers it): review openings from its held-out split as
prompts, the held-out reviews as held-out text; or anything
:func:`~rlkl_lightning.texts.load_texts` reads: local files, a local dataset directory, or a
dataset on the Hugging Face hub (``"imdb"``).

With ``chat_template`` each prompt becomes the user message of a chat (after an optional system
message), written out through the tokenizer's chat template with the assistant's turn opened,
so an instruct model answers it.

Training batches are ``{"prompt": list[str]}``, validation batches
``{"text": list[str]}``: from the held-out text (``val/perplexity``) and, with ``test_heldout``,
from a second loader of test text (``test/perplexity``), which a run may report without
steering on it. Under DDP the training loader deals the prompts of one shared
order to the ranks itself (:class:`~rlkl_lightning.data.samplers.RankShardSampler`); validation
batches are sharded by Lightning's ``DistributedSampler``.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader
from typing_extensions import override

from rlkl_lightning.checkpoints import plain
from rlkl_lightning.data.samplers import EpochShuffleSampler, RankShardSampler, ResumableDataLoader
from rlkl_lightning.data.sources import SourceFiles, named_source, source_file, text_source
from rlkl_lightning.texts import first_words, load_texts

if TYPE_CHECKING:
    import datasets


def collate_dicts(rows: list[dict]) -> dict[str, list]:
    """Turn a list of rows (dicts) into a dict of lists; picklable for worker processes."""
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def options_problem(
    options: Mapping[str, Any], name: Callable[[str], str] = "`{}`".format
) -> str | None:
    """The first of :class:`PromptDataModule`'s options that it refuses, in one line, or None.

    Shared by the module and the command line, which checks a run's ``data`` block before the
    model loads and names each option by its path there (``name``). An option left out is
    taken at its default.
    """
    given = {**_DEFAULTS, **options}
    counts = ("batch_size", "val_batch_size", "num_prompts", "num_heldout", "num_test")
    for option in (*counts, "prompt_words", "heldout_words"):
        value = given[option]
        if value is not None and (isinstance(value, bool) or value < 1):
            return f"{name(option)} must be >= 1 or None, got {value!r}"
    if given["num_workers"] < 0:
        return f"{name('num_workers')} must be >= 0, got {given['num_workers']}"
    for option in ("prompt_column", "heldout_column"):
        if not given[option]:
            return f"{name(option)} must be a non-empty column name"
    if given["test_heldout"] is not None and given["heldout"] is None:
        return (  # the test text is read at validation, with the held-out text
            f"{name('test_heldout')} needs {name('heldout')} (the test text is scored at "
            f"validation, beside the held-out text); set {name('heldout')} or leave out "
            f"{name('test_heldout')}"
        )
    chat = given["system_prompt"] is not None or given["chat_tokenizer"] is not None
    if chat and not given["chat_template"]:
        return (
            f"{name('system_prompt')} and {name('chat_tokenizer')} need "
            f"{name('chat_template')} set to true"
        )
    return None


class PromptDataModule(LightningDataModule):
    """Prompts for PPO rollouts and held-out text for perplexity.

    Args:
        prompts: ``"default"`` (openings of the default world's held-out reviews, its test
            split), ``"default:SPLIT"`` (the whole texts of its ``train``, ``validation`` or
            ``test`` split: with ``prompt_words``, their openings; the same form serves
            ``heldout`` and ``test_heldout``),
            local file(s) (.txt/.csv/.tsv/.json/.jsonl/.parquet), a local dataset
            directory, or a hub dataset name such as ``"imdb"``.
        prompt_column: Column holding the prompt text.
        prompt_split: Split of a hub dataset or directory to take prompts from.
        prompt_words: If set, cut every prompt to its first ``prompt_words`` words
            (makes openings from full texts such as IMDB reviews).
        heldout: Held-out text for validation perplexity, same forms as ``prompts``
            (``"default"``: the default world's held-out reviews, its test split);
            ``None`` disables validation.
        heldout_column: Column holding the held-out text.
        heldout_split: Split of a hub dataset or directory for held-out text.
        heldout_words: If set, cut held-out texts to their first ``heldout_words`` words.
        batch_size: Prompts per training batch (per process under DDP).
        val_batch_size: Held-out texts per validation batch; ``None``: ``batch_size``.
        num_prompts: Keep at most this many prompts (a seeded random subset).
        num_heldout: Keep at most this many held-out texts (a seeded random subset).
        test_heldout: Test text, same forms as ``heldout`` (column ``heldout_column``), whose
            perplexity is logged as ``test/perplexity`` at every validation, as a second
            validation loader; steer on ``val/perplexity`` and report this one, which nothing
            steers on. ``None``: none.
        test_split: Split of ``test_heldout`` (as ``heldout_split``).
        num_test: Keep at most this many test texts (a seeded random subset).
        seed: Seed of the subsets and of the shuffle.
        shuffle: Shuffle the prompts every epoch.
        num_workers: DataLoader worker processes.
        world: Settings of the default world (``None``: the standard one), a mapping of the
            fields of :class:`~rlkl_lightning.world.config.WorldConfig` or one itself; the
            settings of whichever registered source (:mod:`.sources`) ``prompts``,
            ``heldout`` or ``test_heldout`` names, checked here, used only then.
        chat_template: Present each prompt as a user message through the tokenizer's chat
            template, ending with the opened assistant turn (``add_generation_prompt``).
        system_prompt: A system message before every prompt (needs ``chat_template``).
        chat_tokenizer: Tokenizer (name or directory) whose template is used; ``None``: the
            ``tokenizer`` of the module being trained.
    """

    def __init__(
        self,
        prompts: str | list[str] = "default",
        prompt_column: str = "text",
        prompt_split: str = "train",
        prompt_words: int | None = None,
        heldout: str | list[str] | None = "default",
        heldout_column: str = "text",
        heldout_split: str = "test",
        heldout_words: int | None = None,
        batch_size: int = 16,
        val_batch_size: int | None = None,
        num_prompts: int | None = None,
        num_heldout: int | None = 256,
        test_heldout: str | list[str] | None = None,
        test_split: str = "test",
        num_test: int | None = 256,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        world: dict[str, Any] | None = None,
        chat_template: bool = False,
        system_prompt: str | None = None,
        chat_tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        problem = options_problem(
            {
                "batch_size": batch_size,
                "val_batch_size": val_batch_size,
                "num_prompts": num_prompts,
                "num_heldout": num_heldout,
                "num_test": num_test,
                "prompt_words": prompt_words,
                "heldout_words": heldout_words,
                "num_workers": num_workers,
                "prompt_column": prompt_column,
                "heldout_column": heldout_column,
                "heldout": heldout,
                "test_heldout": test_heldout,
                "chat_template": chat_template,
                "system_prompt": system_prompt,
                "chat_tokenizer": chat_tokenizer,
            }
        )
        if problem is not None:
            raise ValueError(f"PromptDataModule: {problem}")
        self.save_hyperparameters(ignore=["world"])
        self.hparams.update(plain(dict(self.hparams)))  # paths as str: see resumable.plain
        #: The settings of each registered source a source option names (:mod:`.sources`).
        self.named = {name: text_source(name).settings(world) for name in self._named_sources()}
        self.world = world
        self.prompt_dataset: datasets.Dataset | None = None
        self._warned_small = False
        self.heldout_dataset: datasets.Dataset | None = None
        self.test_dataset: datasets.Dataset | None = None

    def _named_sources(self) -> list[str]:
        hp = self.hparams
        names = (named_source(s) for s in (hp.prompts, hp.heldout, hp.test_heldout))
        return list(dict.fromkeys(n for n in names if n is not None))

    def _build(self, progress: bool) -> dict[str, SourceFiles]:
        return {name: text_source(name).build(s, progress) for name, s in self.named.items()}

    @override
    def prepare_data(self) -> None:
        """Build the registered sources (the default world) once (local rank 0), if named."""
        self._build(progress=True)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read prompts and held-out text (every process reads the whole set)."""
        if self.prompt_dataset is not None:
            return
        hp = self.hparams
        built = self._build(progress=False)
        # An over-long prompt keeps its end (the pipeline cuts prompts on the left), or its
        # start when only its first words are used.
        keep = "start" if hp.prompt_words else "end"
        if (name := named_source(hp.prompts)) is not None:
            path = source_file(hp.prompts, built[name], "prompts", "prompts")
            prompts = load_texts(path, hp.prompt_column, column_option="prompt_column", keep=keep)
        else:
            prompts = load_texts(hp.prompts, hp.prompt_column, split=hp.prompt_split, keep=keep)
        prompts = self._subset(prompts, hp.num_prompts, hp.prompt_words, salt=0)
        if hp.chat_template:
            prompts = chat_prompts(prompts, self._chat_tokenizer(), hp.system_prompt)
        self.prompt_dataset = _as_dataset("prompt", prompts)
        if hp.heldout is None:
            return
        heldout = self._heldout_texts(built, hp.heldout, hp.heldout_split, "heldout")
        heldout = self._subset(heldout, hp.num_heldout, hp.heldout_words, salt=1)
        self.heldout_dataset = _as_dataset("text", heldout)
        if hp.test_heldout is not None:
            test = self._heldout_texts(built, hp.test_heldout, hp.test_split, "test_heldout")
            test = self._subset(test, hp.num_test, hp.heldout_words, salt=2)
            self.test_dataset = _as_dataset("text", test)

    def _heldout_texts(self, built, source, split: str, option: str) -> list[str]:
        """The texts of a held-out source (``"default"``: the default world's test split)."""
        if (name := named_source(source)) is not None:
            source = source_file(source, built[name], "heldout", option)
        return load_texts(
            source,
            self.hparams.heldout_column,
            split=split,
            source_option=option,
            column_option="heldout_column",
        )

    def _chat_tokenizer(self):
        if self.hparams.chat_tokenizer is not None:
            from rlkl_lightning.models.loading import resolve_model_path
            from rlkl_lightning.models.tokenizer import pretrained_tokenizer

            name = resolve_model_path(self.hparams.chat_tokenizer, "chat_tokenizer")
            return pretrained_tokenizer(name, "chat_tokenizer")
        module = self.trainer.lightning_module if self.trainer is not None else None
        tokenizer = getattr(module, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                "PromptDataModule: `chat_template` needs a tokenizer: set `chat_tokenizer`, or "
                "train a module that has a `tokenizer` attribute"
            )
        return tokenizer

    def _subset(self, texts: list[str], cap: int | None, words: int | None, salt: int) -> list[str]:
        if words is not None:
            texts = [first_words(t, words) for t in texts]
        if cap is not None and cap < len(texts):
            rng = random.Random(self.hparams.seed * 1_000_003 + salt)
            keep = sorted(rng.sample(range(len(texts)), cap))
            texts = [texts[i] for i in keep]
        return texts

    @override
    def train_dataloader(self) -> DataLoader:
        """Batches ``{"prompt": list[str]}``."""
        import torch

        self._require("prompt_dataset", "train_dataloader")
        # The order is a function of (seed, epoch) and the loader's position is checkpointed,
        # so a run resumed mid-epoch sees exactly the remaining batches (see resumable.py).
        # Under DDP each rank takes every world_size-th prompt of that same order, so the
        # global batches equal those of one process with a world_size times larger batch.
        # The generator keeps worker seeding off the global torch RNG that rollouts use.
        n = len(self.prompt_dataset)
        hp = self.hparams
        sampler = EpochShuffleSampler(n, hp.seed) if hp.shuffle else None
        shard = self._shard()
        if shard is not None:
            sampler = RankShardSampler(n, *shard, seed=hp.seed, shuffle=hp.shuffle)
        per_process = n if shard is None else -(-n // shard[0])
        if per_process < hp.batch_size and not self._warned_small:
            from lightning.pytorch.utilities import rank_zero_warn

            self._warned_small = True
            where = "" if shard is None else f" per process ({n} over {shard[0]})"
            rank_zero_warn(
                f"PromptDataModule: `batch_size` is {hp.batch_size} but there are "
                f"{per_process} prompts{where}: every batch holds {per_process} (lower "
                "`batch_size`, or give more prompts; a law's horizon counts samples)"
            )
        return ResumableDataLoader(
            self.prompt_dataset,
            batch_size=hp.batch_size,
            sampler=sampler,
            generator=torch.Generator().manual_seed(hp.seed),
            collate_fn=collate_dicts,
            num_workers=hp.num_workers,
        )

    def _shard(self) -> tuple[int, int] | None:
        """``(world_size, rank)`` under a parallel strategy (DDP, FSDP), else None.

        Also with a single process: Lightning would otherwise replace any sampler that is not a
        ``DistributedSampler`` with its own shuffling one, and a one-process DDP or FSDP run
        would see other batches than a plain run.
        """
        trainer = self.trainer
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer else None
        if not kwargs:
            return None
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    @override
    def val_dataloader(self) -> DataLoader | list:
        """Batches ``{"text": list[str]}``; an empty list if ``heldout`` is None.

        With ``test_heldout`` a list of two loaders: the held-out text, then the test text.
        """
        if self.hparams.heldout is None:
            return []
        self._require("heldout_dataset", "val_dataloader")
        if self.test_dataset is None:
            return self._text_loader(self.heldout_dataset)
        return [self._text_loader(self.heldout_dataset), self._text_loader(self.test_dataset)]

    def _text_loader(self, dataset) -> DataLoader:
        import torch

        return DataLoader(
            dataset,
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            generator=torch.Generator().manual_seed(self.hparams.seed),
            collate_fn=collate_dicts,
            num_workers=self.hparams.num_workers,
        )

    def _require(self, attribute: str, method: str) -> None:
        if getattr(self, attribute) is None:
            raise RuntimeError(f"PromptDataModule.{method}: call setup() first")


def chat_prompts(prompts: list[str], tokenizer, system_prompt: str | None = None) -> list[str]:
    """Each prompt as a user message, through ``tokenizer``'s chat template, assistant turn open.

    A template that writes the BOS token itself would get a second one when the text is
    tokenized (tokenizers that add BOS do so again): such a leading BOS is removed here.

    Raises:
        ValueError: If the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"PromptDataModule: `chat_template` is set but the tokenizer "
            f"{getattr(tokenizer, 'name_or_path', '')!r} has no chat template; use an instruct "
            "model's tokenizer (`chat_tokenizer`), or `chat_template: false`"
        )
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    out = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if adds_bos and text.startswith(bos):
            text = text[len(bos) :]
        out.append(text)
    return out


def _as_dataset(column: str, texts: list[str]) -> datasets.Dataset:
    import datasets

    return datasets.Dataset.from_dict({column: texts})


#: PromptDataModule's defaults, for :func:`options_problem`'s options left out.
_DEFAULTS = {
    p.name: p.default
    for p in inspect.signature(PromptDataModule.__init__).parameters.values()
    if p.default is not p.empty
}
