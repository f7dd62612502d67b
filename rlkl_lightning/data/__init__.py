"""Training data: prompts and held-out texts, and the samplers that make data order resumable."""

from rlkl_lightning.data.prompts import PromptDataModule, chat_prompts

__all__ = ["PromptDataModule", "chat_prompts"]
