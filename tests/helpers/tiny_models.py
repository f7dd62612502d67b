"""Tiny models made locally (nothing is downloaded), and a check that two of them agree.

``make_tiny_lm`` saves a word-level tokenizer and a random GPT-2 (``tests/conftest.py`` makes
the session's ``tiny_lm_dir`` with it); ``save_tiny_classifier`` a GPT-2 sequence classifier.
torch is imported inside the functions: ``conftest.py`` sets ``OMP_NUM_THREADS`` before it.
"""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "good bad the a film book food was is very not really great awful fine dull "
    "plot taste story and but it this too quite nice poor"
).split()


def make_tiny_lm(
    path: Path, *, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, seed: int = 0
) -> Path:
    """Save a word-level tokenizer and a randomly initialised GPT-2 to ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(vocab),
        n_positions=64,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_same_loss_and_grads(plain, other, loss_tol: dict, grad_tol: dict) -> None:
    """The LM losses of two models on one random batch agree, and so do all their gradients."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(4, plain.config.vocab_size, (3, 12))
    losses = []
    for model in (plain, other):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], **loss_tol)
    for (name, p), q in zip(plain.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **grad_tol, msg=name)


CORPUS = [
    "the film was great and the story was moving",
    "a terrible boring movie that was far too long",
    "wonderful acting and a lovely ending",
    "i did not like the plot at all",
    "this film is wonderful and moving",
]


def save_tiny_classifier(path, with_pad: bool = True, num_labels: int = 2) -> None:
    """A 1-layer GPT-2 classifier and a word-level tokenizer trained on CORPUS, saved to path."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    specials = ["[UNK]", "[PAD]", "[EOS]"] if with_pad else ["[UNK]", "[EOS]"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    kwargs = {"pad_token": "[PAD]"} if with_pad else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]", **kwargs
    )
    fast.save_pretrained(path)
    labels = ["NEGATIVE", "POSITIVE"] if num_labels == 2 else ["LABEL_0"]
    config = GPT2Config(
        vocab_size=len(fast),
        n_positions=32,
        n_embd=16,
        n_layer=1,
        n_head=2,
        num_labels=num_labels,
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
        bos_token_id=fast.eos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id if with_pad else None,
    )
    torch.manual_seed(0)
    GPT2ForSequenceClassification(config).save_pretrained(path)
