"""Loading a tokenizer as saved: the one loader of policies, the world's SFT and the export."""

from __future__ import annotations


def pretrained_tokenizer(
    name_or_path: str, option: str = "tokenizer", trust_remote_code: bool = False
):
    """A tokenizer from a directory or the hub, as saved (``AutoTokenizer.from_pretrained``).

    Args:
        name_or_path: Local directory (``save_pretrained``) or hub name.
        option: Name of the option that gave ``name_or_path``, for the error message.
        trust_remote_code: Run tokenizer code shipped with it (off: such a tokenizer is
            refused with an error, never a prompt).

    Raises:
        ValueError: If no tokenizer can be loaded from ``name_or_path``.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"`{option}`: could not load a tokenizer from {name_or_path!r}: {err}"
        ) from err
