"""A Hugging Face tokenizer directory as distlm's vocabulary, read offline with ``tokenizers``.

The directory holds ``tokenizer.json`` and, usually, ``tokenizer_config.json`` and
``special_tokens_map.json``. The ids the data pipeline needs come from those two files,
``special_tokens_map.json`` winning where both name a token (transformers reads them the
same way):

=======  ===========================================  ====================
role     setting (first one present)                   conventional token
=======  ===========================================  ====================
bos      ``bos_token``, then ``cls_token``              ``<s>``
eos      ``eos_token``, then ``sep_token``              ``</s>``
pad      ``pad_token``                                  ``<pad>``
unk      ``unk_token``                                  ``<unk>``
mask     ``mask_token``                                 ``<mask>``
=======  ===========================================  ====================

A role that neither file names takes its conventional token when ``tokenizer.json``
holds it as a special token (as a tokenizer trained with ``tokenizers`` and saved alone
does); otherwise the tokenizer has no such token. What each task needs is checked in
:meth:`HFVocabulary.load`.

:func:`train_tokenizer` trains a byte-level tokenizer on raw text (``distlm.prepare``
without ``--tokenizer``); saved with a model, it adds the special tokens of the model's
task (see :func:`save_tokenizer`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distlm.choices import TOKENIZER_MODELS
from distlm.data.dictionary import (
    BOS_SYMBOL,
    EOS_SYMBOL,
    MASK_SYMBOL,
    PAD_SYMBOL,
    SPECIAL_SYMBOLS,
    UNK_SYMBOL,
    Vocabulary,
)
from distlm.data.tokenizer import NUM_BYTES, task_post_processor, write_hf_tokenizer
from distlm.errors import UsageError, first_line

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # later files win
# Everything transformers' AutoTokenizer may read from a tokenizer directory.
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    *CONFIG_FILES,
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)
# role -> (settings that name it, in order of preference; conventional token)
_ROLES: dict[str, tuple[tuple[str, ...], str]] = {
    "bos": (("bos_token", "cls_token"), "<s>"),
    "eos": (("eos_token", "sep_token"), "</s>"),
    "pad": (("pad_token",), "<pad>"),
    "unk": (("unk_token",), "<unk>"),
    "mask": (("mask_token",), "<mask>"),
}


# tokenizer_config.json key of a tokenizer train_tokenizer made: {"model": ..., "vocab_size": ...}.
TRAINED_KEY = "distlm_trained"
# The special tokens of a trained tokenizer, at ids 0-4 in fairseq's order (then <mask>).
TRAINED_SPECIALS = (*SPECIAL_SYMBOLS, MASK_SYMBOL)
DEFAULT_VOCAB_SIZE = 16000


def import_tokenizers(purpose: str):
    """The ``tokenizers`` package, or a one-line refusal naming ``purpose`` and the extra."""
    try:
        import tokenizers
    except ImportError:
        raise UsageError(f"{purpose} needs the tokenizers package; pip install 'distlm[hf]'") from None
    return tokenizers


def is_hf_tokenizer_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a Hugging Face ``tokenizer.json``."""
    return (Path(directory) / TOKENIZER_FILE).is_file()


def load_tokenizer(directory: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` of ``directory/tokenizer.json`` (no download, ever)."""
    directory = Path(directory)
    path = directory / TOKENIZER_FILE
    if not directory.is_dir():
        raise UsageError(f"tokenizer directory {directory} does not exist; pass a Hugging Face tokenizer directory")
    if not path.is_file():
        raise UsageError(
            f"tokenizer directory {directory} has no {TOKENIZER_FILE}; save the tokenizer with "
            f"save_pretrained() (a fast tokenizer) or Tokenizer.save()"
        )
    Tokenizer = import_tokenizers(f"reading {path}").Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise UsageError(f"{path} is not a readable Hugging Face tokenizer ({first_line(err)})") from None


def read_special_token_names(directory: str | os.PathLike) -> dict[str, str]:
    """``{setting: token}`` from the directory's config files, e.g. ``{"eos_token": "</s>"}``."""
    names: dict[str, str] = {}
    for file_name in CONFIG_FILES:
        config = read_config_file(Path(directory) / file_name)
        for setting in {setting for settings, _ in _ROLES.values() for setting in settings}:
            token = _token_content(config.get(setting))
            if token is not None:
                names[setting] = token
    return names


def read_config_file(path: Path) -> dict[str, Any]:
    """The JSON object of a tokenizer config file ({} when there is no such file)."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path} cannot be read as JSON ({err}); fix or remove it") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} must hold a JSON object; fix or remove it")
    return config


def _token_content(value: Any) -> str | None:
    """A token as config files spell it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFVocabulary:
    """A Hugging Face tokenizer's vocabulary with :class:`Dictionary`'s interface.

    ``len()`` is the largest id plus one (added tokens included), ``symbols`` the token of
    every id, and ``bos()``, ``eos()``, ``pad()``, ``unk()``, ``mask()`` the ids of the
    roles in the module docstring; asking for a role the tokenizer lacks is a
    ``UsageError`` naming the tokenizer. ``tokenizer_dir`` is where its files are.

    Causal LMs without a pad token (Llama's tokenizers have none) pad with the eos id:
    padded positions carry no loss and causal attention never looks ahead at them, so the
    id only has to exist. Masked LMs need a real pad token, because RoBERTa masks pads
    out of attention and would mask every ``</s>`` too.
    """

    def __init__(self, directory: Path, symbols: list[str], role_ids: dict[str, int | None], special_ids: list[int]):
        self.tokenizer_dir = directory
        self.symbols = symbols
        self._role_ids = role_ids
        self._special_ids = sorted(set(special_ids) | {i for i in role_ids.values() if i is not None})
        self._indices = {symbol: index for index, symbol in enumerate(symbols) if symbol}

    @classmethod
    def load(cls, directory: str | os.PathLike, task: str | None = None, tokenizer=None) -> HFVocabulary:
        """Read ``directory``; ``task`` (masked_lm or causal_lm) checks that its tokens are there.

        masked_lm needs a mask, a bos (``<s>``/``[CLS]``) and a pad token; causal_lm needs an
        eos (end-of-document) token and pads with it when there is no pad token.
        """
        directory = Path(directory)
        tokenizer = load_tokenizer(directory) if tokenizer is None else tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1 if vocab else 0
        symbols = [""] * size
        for token, index in vocab.items():
            symbols[index] = token
        special_ids = [index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special]

        names = read_special_token_names(directory)
        role_ids: dict[str, int | None] = {}
        for role, (settings, conventional) in _ROLES.items():
            setting = next((setting for setting in settings if setting in names), None)
            if setting is not None:
                index = vocab.get(names[setting])
                if index is None:
                    raise UsageError(
                        f"{directory} names {setting} {names[setting]!r}, which {directory / TOKENIZER_FILE} does not "
                        f"hold; fix the tokenizer's config files"
                    )
                role_ids[role] = index
            else:
                index = vocab.get(conventional)
                role_ids[role] = index if index in special_ids else None

        vocabulary = cls(directory, symbols, role_ids, special_ids)
        if task == "masked_lm":
            for role in ("mask", "bos", "pad"):
                vocabulary.require(role, "masked_lm")
            if role_ids["pad"] in (role_ids["bos"], role_ids["eos"], role_ids["mask"]):
                raise UsageError(
                    f"tokenizer {directory} pads with {symbols[role_ids['pad']]!r}, which is also its bos, eos or mask "
                    f"token; masked_lm needs a pad token of its own (set pad_token in {directory / CONFIG_FILES[0]})"
                )
        elif task == "causal_lm":
            vocabulary.require("eos", "causal_lm")
            if role_ids["pad"] is None:
                role_ids["pad"] = role_ids["eos"]
                logger.info("tokenizer %s has no pad token; causal_lm pads with eos, id %d", directory, role_ids["eos"])
        return vocabulary

    def require(self, role: str, purpose: str | None = None) -> int:
        """Id of ``role``'s token; a ``UsageError`` naming ``purpose`` when the tokenizer has none."""
        index = self._role_ids.get(role)
        if index is None:
            settings, conventional = _ROLES[role]
            needed_by = f", which {purpose} needs" if purpose else ""
            raise UsageError(
                f"tokenizer {self.tokenizer_dir} has no {role} token ({' or '.join(settings)}){needed_by}; "
                f"add one (e.g. {conventional!r}) and name it in {self.tokenizer_dir / CONFIG_FILES[0]}"
            )
        return index

    def bos(self) -> int:
        return self.require("bos")

    def eos(self) -> int:
        return self.require("eos")

    def pad(self) -> int:
        return self.require("pad")

    def unk(self) -> int:
        return self.require("unk")

    def mask(self) -> int:
        return self.require("mask", "masked_lm")

    def has(self, role: str) -> bool:
        """Whether the tokenizer has a token for ``role`` (bos, eos, pad, unk, mask)."""
        return self._role_ids.get(role) is not None

    def special_indices(self) -> list[int]:
        """Ids of every special token (those ``tokenizer.json`` marks special, and the roles)."""
        return list(self._special_ids)

    def index(self, symbol: str) -> int:
        """Id of ``symbol``, or of the unk token when the vocabulary lacks it."""
        return self._indices[symbol] if symbol in self._indices else self.unk()

    def copy_tokenizer_files(self, out_dir: str | os.PathLike) -> list[Path]:
        """Copy the tokenizer's files into ``out_dir`` (see :func:`copy_tokenizer_files`)."""
        return copy_tokenizer_files(self.tokenizer_dir, out_dir)

    def __len__(self) -> int:
        return len(self.symbols)

    def __contains__(self, symbol: str) -> bool:
        return symbol in self._indices

    def __getitem__(self, index: int) -> str:
        return self.symbols[index]

    def __eq__(self, other: object) -> bool:
        return hasattr(other, "symbols") and self.symbols == other.symbols

    def __repr__(self) -> str:
        return f"HFVocabulary({len(self)} tokens from {self.tokenizer_dir})"


def copy_tokenizer_files(source_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Copy a Hugging Face tokenizer's files (those of ``TOKENIZER_FILES`` present) into ``out_dir``."""
    source, target = Path(source_dir), Path(out_dir)
    if not is_hf_tokenizer_dir(source):
        raise UsageError(f"{source} has no {TOKENIZER_FILE}; it is not a Hugging Face tokenizer directory")
    if target.exists() and not target.is_dir():
        raise UsageError(f"{target} is a file; name a directory to copy the tokenizer files into")
    try:
        target.mkdir(parents=True, exist_ok=True)
        copied = []
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                if not (target / name).exists() or not (source / name).samefile(target / name):
                    shutil.copyfile(source / name, target / name)
                copied.append(target / name)
    except OSError as err:
        raise UsageError(f"cannot copy the tokenizer files of {source} into {target} ({err.strerror})") from None
    return copied


def check_tokenizer_training(model: str, vocab_size: int) -> None:
    """Refuse settings :func:`train_tokenizer` cannot train with, and a missing ``tokenizers``,
    before any text is read."""
    if model not in TOKENIZER_MODELS:
        raise UsageError(f"--tokenizer-model {model} is not one of {', '.join(TOKENIZER_MODELS)}")
    smallest = NUM_BYTES + len(TRAINED_SPECIALS)
    if vocab_size < smallest:
        raise UsageError(f"--vocab-size {vocab_size} is below {smallest}: a byte-level tokenizer holds the "
                         f"{NUM_BYTES} bytes and {len(TRAINED_SPECIALS)} special tokens; give at least {smallest}")
    import_tokenizers("training a tokenizer (--input without --tokenizer)")


def train_tokenizer(documents: Iterable[str], out_dir: str | os.PathLike, model: str = "bpe",
                    vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[Path]:
    """Train a byte-level ``model`` (bpe or unigram) tokenizer of at most ``vocab_size``
    tokens on ``documents`` and write it into ``out_dir`` as Hugging Face files.

    Text is split as GPT-2 and RoBERTa split it and every UTF-8 byte is one of the 256
    base symbols, so any text encodes with no unknown token and decodes back exactly.
    ``<s> <pad> </s> <unk> <mask>`` take ids 0-4 (fairseq's order, as in the built-in
    corpus's dictionary). The tokenizer adds no special tokens itself; ``tokenizer_config.json``
    marks it as trained here, so a checkpoint's copy adds its task's (:func:`save_tokenizer`).
    BPE training is deterministic; unigram training can order tied pieces differently
    from run to run.
    """
    check_tokenizer_training(model, vocab_size)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    common = {"vocab_size": vocab_size, "special_tokens": list(TRAINED_SPECIALS), "show_progress": False,
              "initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
    if model == "bpe":
        tokenizer, trainer = Tokenizer(models.BPE()), trainers.BpeTrainer(**common)
    else:
        tokenizer, trainer = Tokenizer(models.Unigram()), trainers.UnigramTrainer(unk_token=UNK_SYMBOL, **common)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(documents, trainer)

    roles = {"bos_token": BOS_SYMBOL, "eos_token": EOS_SYMBOL, "pad_token": PAD_SYMBOL,
             "unk_token": UNK_SYMBOL, "mask_token": MASK_SYMBOL}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **roles,
        # A "</s>" typed in a document is text, as prepare encodes it.
        "split_special_tokens": True,
        # The default clean-up would change decoded text (" ." -> ".").
        "clean_up_tokenization_spaces": False,
        TRAINED_KEY: {"model": model, "vocab_size": vocab_size},
    }
    out = Path(out_dir)
    paths = [out / TOKENIZER_FILE, *(out / name for name in CONFIG_FILES)]
    try:
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(paths[0]))
        paths[1].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        paths[2].write_text(json.dumps(roles, indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise UsageError(f"cannot write the tokenizer files into {out} ({err.strerror})") from None
    return paths


def save_tokenizer(vocabulary: Vocabulary, out_dir: str | os.PathLike, task: str) -> list[Path]:
    """Hugging Face tokenizer files for the vocabulary a model was trained with.

    An :class:`HFVocabulary` copies its tokenizer's files; one that :func:`train_tokenizer`
    made then adds the special tokens the data pipeline puts around a document for
    ``task``, as the byte-level tokenizer does. A byte-level :class:`Dictionary` (the
    built-in corpus's) writes the equivalent tokenizer (see
    :func:`distlm.data.tokenizer.write_hf_tokenizer`). Any other ``dict.txt`` vocabulary
    has no tokenizer distlm knows of: a ``UsageError``.
    """
    if not isinstance(vocabulary, HFVocabulary):
        return write_hf_tokenizer(vocabulary, out_dir, task)
    copied = vocabulary.copy_tokenizer_files(out_dir)
    if TRAINED_KEY in read_config_file(vocabulary.tokenizer_dir / CONFIG_FILES[0]):
        path = Path(out_dir) / TOKENIZER_FILE
        try:
            tokenizer = json.loads(path.read_text(encoding="utf-8"))
            ids = {BOS_SYMBOL: vocabulary.bos(), EOS_SYMBOL: vocabulary.eos()}
            tokenizer["post_processor"] = task_post_processor(task, ids)
            path.write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as err:
            raise UsageError(f"cannot add {task}'s special tokens to {path} ({err.strerror})") from None
    return copied
