"""fairseq's ``dict.txt`` vocabulary: symbol <-> index, with the four fixed specials.

The file lists one ``symbol count`` per line. The specials ``<s>``, ``<pad>``, ``</s>`` and
``<unk>`` are implicit and always take indices 0-3, so the first line of the file is index
4. Reading data binarized by ``fairseq-preprocess`` depends on matching this exact
numbering.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from distlm.errors import UsageError

BOS_SYMBOL = "<s>"
PAD_SYMBOL = "<pad>"
EOS_SYMBOL = "</s>"
UNK_SYMBOL = "<unk>"
MASK_SYMBOL = "<mask>"
SPECIAL_SYMBOLS = (BOS_SYMBOL, PAD_SYMBOL, EOS_SYMBOL, UNK_SYMBOL)

# fairseq writes this flag after the count when a line deliberately redefines a symbol
# that is already present (for example, a special symbol repeated in dict.txt).
_OVERWRITE_FLAG = "#fairseq:overwrite"


class Vocabulary(Protocol):
    """What the data pipeline, the models and checkpoints use of a vocabulary.

    :class:`Dictionary` (fairseq's ``dict.txt``) and ``HFVocabulary`` (a Hugging Face
    tokenizer) both provide it. ``symbols`` lists the token of every id; checkpoints
    store it to refuse resuming on other data.
    """

    symbols: list[str]

    def __len__(self) -> int: ...

    def bos(self) -> int: ...

    def pad(self) -> int: ...

    def eos(self) -> int: ...

    def unk(self) -> int: ...

    def mask(self) -> int: ...

    def special_indices(self) -> list[int]: ...


class Dictionary:
    """An ordered symbol table with fairseq's numbering: ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3."""

    def __init__(self) -> None:
        self.symbols: list[str] = []
        self.counts: list[int] = []
        self._indices: dict[str, int] = {}
        for symbol in SPECIAL_SYMBOLS:
            self.add_symbol(symbol, count=0)
        self.nspecial = len(SPECIAL_SYMBOLS)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Dictionary:
        """Read a fairseq ``dict.txt`` (``symbol count [#fairseq:overwrite]`` per line)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(
                f"dictionary {path} does not exist; point the data path at a "
                f"fairseq-preprocess output directory containing dict.txt"
            ) from None
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"dictionary {path} cannot be read as UTF-8 text ({err}); regenerate it") from None

        dictionary = cls()
        for line_number, line in enumerate(text.splitlines(), start=1):
            line = line.rstrip()
            if not line:
                continue
            dictionary._add_line(line, path, line_number)
        return dictionary

    def _add_line(self, line: str, path: Path, line_number: int) -> None:
        where = f"dictionary {path} line {line_number}"
        symbol, _, field = line.rpartition(" ")
        overwrite = field == _OVERWRITE_FLAG
        if overwrite:
            symbol, _, field = symbol.rpartition(" ")
        if not symbol:
            raise UsageError(f"{where}: expected 'symbol count', got {line!r}; regenerate dict.txt")
        try:
            count = int(field)
        except ValueError:
            raise UsageError(f"{where}: count {field!r} is not an integer; regenerate dict.txt") from None
        if symbol in self._indices and not overwrite:
            raise UsageError(
                f"{where}: duplicate symbol {symbol!r}; remove it or add '{_OVERWRITE_FLAG}' "
                f"as fairseq does"
            )
        if overwrite and symbol in self._indices:
            self.counts[self._indices[symbol]] = count
        else:
            self.add_symbol(symbol, count=count)

    def save(self, path: str | os.PathLike) -> None:
        """Write the non-special symbols with their counts, the inverse of :meth:`load`."""
        entries = zip(self.symbols[self.nspecial :], self.counts[self.nspecial :])
        Path(path).write_text("".join(f"{symbol} {count}\n" for symbol, count in entries), encoding="utf-8")

    @classmethod
    def from_symbols(cls, symbols: Iterable[str]) -> Dictionary:
        """Rebuild a dictionary from its symbol list, as stored in a checkpoint."""
        symbols = list(symbols)
        if tuple(symbols[: len(SPECIAL_SYMBOLS)]) != SPECIAL_SYMBOLS:
            raise UsageError(
                f"dictionary symbols must start with {list(SPECIAL_SYMBOLS)}, got "
                f"{symbols[: len(SPECIAL_SYMBOLS)]}; the checkpoint's vocabulary is not a distlm/fairseq one"
            )
        dictionary = cls()
        for symbol in symbols[len(SPECIAL_SYMBOLS) :]:
            if symbol in dictionary._indices:
                raise UsageError(f"dictionary symbols contain {symbol!r} twice; the checkpoint's vocabulary is corrupt")
            dictionary.add_symbol(symbol, count=0)
        return dictionary

    def add_symbol(self, symbol: str, count: int = 1) -> int:
        """Append ``symbol`` (or add to its count when present) and return its index."""
        if symbol in self._indices:
            index = self._indices[symbol]
            self.counts[index] += count
            return index
        index = len(self.symbols)
        self.symbols.append(symbol)
        self.counts.append(count)
        self._indices[symbol] = index
        return index

    def index(self, symbol: str) -> int:
        """Index of ``symbol``, or of ``<unk>`` when it is not in the dictionary (fairseq's rule)."""
        return self._indices.get(symbol, self.unk())

    def bos(self) -> int:
        return self._indices[BOS_SYMBOL]

    def pad(self) -> int:
        return self._indices[PAD_SYMBOL]

    def eos(self) -> int:
        return self._indices[EOS_SYMBOL]

    def unk(self) -> int:
        return self._indices[UNK_SYMBOL]

    def mask(self) -> int:
        """Index of ``<mask>``; the masked-LM task adds it with ``add_symbol``."""
        if MASK_SYMBOL not in self._indices:
            raise UsageError(
                f"the dictionary has no {MASK_SYMBOL} symbol; masked_lm adds it with add_symbol('{MASK_SYMBOL}')"
            )
        return self._indices[MASK_SYMBOL]

    def special_indices(self) -> list[int]:
        """Indices that are never masked and never predicted as random replacements."""
        specials = list(range(self.nspecial))
        if MASK_SYMBOL in self._indices:
            specials.append(self._indices[MASK_SYMBOL])
        return specials

    def __len__(self) -> int:
        return len(self.symbols)

    def __contains__(self, symbol: str) -> bool:
        return symbol in self._indices

    def __getitem__(self, index: int) -> str:
        return self.symbols[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dictionary) and self.symbols == other.symbols

    def __repr__(self) -> str:
        return f"Dictionary({len(self)} symbols)"
