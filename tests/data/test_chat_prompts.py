"""Prompts as chat messages through a tokenizer's chat template (PromptDataModule)."""

from __future__ import annotations

import pytest
from helpers.trainers import fit_on_prompts
from lightning.pytorch import Callback
from transformers import AutoTokenizer

from rlkl_lightning import PPOModule
from rlkl_lightning.data import PromptDataModule, chat_prompts
from rlkl_lightning.models.loading import load_tokenizer
from rlkl_lightning.rewards import FunctionReward

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
PROMPTS = ["the film was", "this book is", "the food", "a story"]


@pytest.fixture
def chat_lm_dir(tmp_path):
    """The tiny LM with a chat template saved in its tokenizer."""
    from helpers.tiny_models import make_tiny_lm

    path = make_tiny_lm(tmp_path / "chat_lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def test_prompts_are_written_through_the_template_with_the_assistant_turn_open(chat_lm_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)
    assert tokenizer("the")["input_ids"][0] != tokenizer.bos_token_id  # adds no BOS itself
    got = chat_prompts(["the film was"], tokenizer, system_prompt="be good")
    assert got == ["<bos>[system] be good <eos> [user] the film was <eos> [assistant] "]
    assert chat_prompts(["a"], tokenizer) == ["<bos>[user] a <eos> [assistant] "]


def test_a_bos_written_by_the_template_is_not_doubled(chat_lm_dir):
    from tokenizers.processors import TemplateProcessing

    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    (text,) = chat_prompts(["the film was"], tokenizer)
    assert text == "[user] the film was <eos> [assistant] "
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == bos and ids[1] != bos  # one BOS, added by the tokenizer


class SeenPrompts(Callback):
    def __init__(self):
        self.prompts: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.prompts += batch["prompt"]


def test_a_run_trains_on_chat_prompts_with_the_modules_tokenizer(chat_lm_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    data = PromptDataModule(
        str(prompts), heldout=None, batch_size=2, chat_template=True, system_prompt="be good"
    )
    module = PPOModule(
        policy=str(chat_lm_dir),
        reward=FunctionReward(lambda p, r: float(len(r.split()))),
        sampling={"max_prompt_tokens": 24, "max_new_tokens": 4},
        optimization={"ppo_epochs": 1, "num_minibatches": 1},
        logging={"log_samples_every": 0},
    )
    seen = SeenPrompts()
    fit_on_prompts(module, data, callbacks=[seen], max_steps=2)
    assert module.batches_seen == 2
    tokenizer = load_tokenizer(str(chat_lm_dir))
    assert sorted(seen.prompts) == sorted(chat_prompts(PROMPTS, tokenizer, "be good"))


def test_chat_options_name_the_problem(tiny_lm_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    with pytest.raises(ValueError, match="`system_prompt` and `chat_tokenizer` need"):
        PromptDataModule(str(prompts), heldout=None, system_prompt="hi")
    data = PromptDataModule(
        str(prompts), heldout=None, chat_template=True, chat_tokenizer=str(tiny_lm_dir)
    )
    with pytest.raises(ValueError, match="has no chat template"):
        data.setup("fit")
    with pytest.raises(ValueError, match="`chat_template` needs a tokenizer"):
        PromptDataModule(str(prompts), heldout=None, chat_template=True).setup("fit")
