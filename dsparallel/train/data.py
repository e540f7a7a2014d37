"""The trainer's data: the user's text files read with Hugging Face
``datasets``, tokenized, an end-of-text token after each document, packed
into full sequences of ``seq_len`` tokens.

Each data-parallel rank reads its own share of the documents (every
``dp``-th of the epoch's order, which the seed and the epoch number fix), so
that each document's tokens appear exactly once per epoch over the ranks;
the tensor, pipeline and context-parallel ranks of one replica read the
same share. A rank's place in its stream is three numbers (epoch, document
within its share, token within that document): ``state()`` gives them and
``load_state()`` puts them back, so a resumed run reads exactly the batches
the uninterrupted run would have.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import torch

KINDS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_TOKENIZE_AHEAD = 64  # documents tokenized in one batch call


def expand(patterns: list[str], what: str) -> list[str]:
    """The files ``patterns`` match (``**`` recurses), sorted, each once."""
    if not patterns:
        raise ValueError(f"[data] {what}: no file patterns given")
    files: list[str] = []
    for pattern in patterns:
        found = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not found:
            raise FileNotFoundError(f"[data] {what}: no file matches {pattern!r}")
        files.extend(f for f in found if f not in files)
    kinds = {KINDS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds:
        odd = next(f for f in files if os.path.splitext(f)[1].lower() not in KINDS)
        raise ValueError(
            f"[data] {what}: {odd}: not a text file of a known kind ({', '.join(sorted(KINDS))})"
        )
    if len(kinds) > 1:
        raise ValueError(
            f"[data] {what}: the patterns match files of several kinds ({sorted(kinds)}); "
            "give one kind of file per list"
        )
    return files


def check_jsonl(path: str, text_field: str) -> None:
    """Raises naming the file and line of the first row that is not a JSON
    object with a string ``text_field`` (``datasets`` would name neither)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a JSON {type(row).__name__}, not an object")
            if text_field not in row:
                raise ValueError(
                    f"{path}:{number}: no field {text_field!r} (fields: {', '.join(row)}); "
                    "set [data] text_field"
                )
            if not isinstance(row[text_field], str):
                raise ValueError(
                    f"{path}:{number}: field {text_field!r} is a "
                    f"{type(row[text_field]).__name__}, not a string"
                )


def check_parquet(path: str, text_field: str) -> None:
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    if text_field not in names:
        raise ValueError(
            f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set [data] text_field"
        )


def check_files(files: list[str], text_field: str) -> None:
    for path in files:
        kind = KINDS[os.path.splitext(path)[1].lower()]
        if kind == "json":
            check_jsonl(path, text_field)
        elif kind == "parquet":
            check_parquet(path, text_field)


def load_documents(files: list[str], text_field: str, sample_by: str, streaming: bool):
    """The documents of ``files`` (already checked) as a ``datasets``
    dataset with one column, ``text``."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    kind = KINDS[os.path.splitext(files[0])[1].lower()]
    options = {}
    if kind == "text":
        if sample_by not in ("document", "paragraph", "line"):
            raise ValueError(
                f"[data] txt_sample_by: {sample_by!r} is not document, paragraph or line"
            )
        options["sample_by"] = sample_by
    ds = datasets.load_dataset(
        kind, data_files=files, split="train", streaming=streaming, **options
    )
    if kind != "text":
        ds = ds.select_columns([text_field])
        if text_field != "text":
            ds = ds.rename_column(text_field, "text")
    return ds


class Tokenizer:
    """A ``tokenizer.json`` (the ``tokenizers`` library, as ``transformers``'
    fast tokenizers) with its end-of-text (and beginning-of-text) ids, from
    ``tokenizer_config.json``, the model's ``config.json`` or the usual
    token names."""

    FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    END_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
    BEGIN_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")

    def __init__(self, directory: str):
        from tokenizers import Tokenizer as Fast

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"[data] tokenizer: {path} does not exist (a directory with tokenizer.json: "
                "set [data] tokenizer, or train one with python -m dsparallel.train.tokenizer)"
            )
        self.path, self.directory = path, directory
        self.fast = Fast.from_file(path)
        with open(path) as f:  # what a checkpoint records of it (not of its formatting)
            canonical = json.dumps(json.load(f), sort_keys=True).encode()
        digest = hashlib.sha256(canonical).digest()
        self.fingerprint = int.from_bytes(digest[:8], "little", signed=True)
        self.vocab_size = self.fast.get_vocab_size(with_added_tokens=True)
        settings = _read_json(os.path.join(directory, "tokenizer_config.json"))
        config = _read_json(os.path.join(directory, "config.json"))
        self.eos_id = self._special(settings.get("eos_token"), config.get("eos_token_id"))
        if self.eos_id is None:
            self.eos_id = self._named(self.END_NAMES)
        if self.eos_id is None:
            raise ValueError(
                f"[data] tokenizer {directory}: no end-of-text token (none in "
                "tokenizer_config.json's eos_token or config.json's eos_token_id, and none of "
                f"{', '.join(self.END_NAMES)} in the vocabulary)"
            )
        bos = self._special(settings.get("bos_token"), config.get("bos_token_id"))
        self.bos_id = bos if bos is not None else self._named(self.BEGIN_NAMES)

    def copy_to(self, directory: str) -> None:
        """Its files into ``directory`` (beside an exported checkpoint), so
        that the checkpoint brings its tokenizer."""
        import shutil

        for name in self.FILES:
            source = os.path.join(self.directory, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(directory, name))

    def _special(self, token, token_id) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and self.fast.token_to_id(token) is not None:
            return self.fast.token_to_id(token)
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        return token_id if isinstance(token_id, int) else None

    def _named(self, names) -> int | None:
        for name in names:
            if self.fast.token_to_id(name) is not None:
                return self.fast.token_to_id(name)
        return None

    def encode(self, texts: list[str], add_bos: bool) -> list[list[int]]:
        """Each text's ids, the end-of-text id after each (and the
        beginning-of-text id before, with ``add_bos``)."""
        if add_bos and self.bos_id is None:
            raise ValueError(f"[data] add_bos: the tokenizer {self.path} has no beginning token")
        head = [self.bos_id] if add_bos else []
        out = self.fast.encode_batch(texts, add_special_tokens=False)
        return [head + e.ids + [self.eos_id] for e in out]


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


class PackedStream:
    """This data-parallel rank's sequences: its share of each epoch's
    documents, tokenized and cut into ``seq_len`` windows that run on from
    one document into the next. ``shuffle=False`` keeps the files' order
    and reads one epoch (evaluation)."""

    def __init__(
        self,
        documents,
        tokenizer: Tokenizer,
        seq_len: int,
        rank: int,
        world: int,
        seed: int,
        add_bos: bool = False,
        shuffle: bool = True,
    ):
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.rank, self.world = rank, world
        self.seed, self.add_bos, self.shuffle = seed, add_bos, shuffle
        self.streaming = not hasattr(documents, "__len__")
        if not self.streaming and len(documents) < world:
            raise ValueError(
                f"[data] {len(documents)} document(s) cannot be shared by {world} data-parallel "
                "ranks: give more documents (or split them with txt_sample_by)"
            )
        self.epoch, self.doc, self.offset = 0, 0, 0
        self._start_epoch()

    # ------------------------------------------------------------ the order

    def _start_epoch(self) -> None:
        self._cache: dict[int, list[int]] = {}
        if self.streaming:
            from datasets.distributed import split_dataset_by_node

            ds = self.documents
            if self.shuffle:
                ds = ds.shuffle(seed=self.seed, buffer_size=10_000)
                ds.set_epoch(self.epoch)
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world)
            self._iter = iter(ds.skip(self.doc) if self.doc else ds)
            self._next_streamed = self.doc
            return
        n = len(self.documents)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        self._share = order[self.rank :: self.world].tolist()

    def _tokens(self, doc: int) -> list[int] | None:
        """The ids of document ``doc`` of this epoch's share; None past its end."""
        if doc not in self._cache:
            self._cache.clear()
            texts = []
            if self.streaming:
                assert doc == self._next_streamed, (doc, self._next_streamed)
                for row in self._iter:
                    texts.append(row["text"])
                    if len(texts) == _TOKENIZE_AHEAD:
                        break
                self._next_streamed += len(texts)
            else:
                ids = self._share[doc : doc + _TOKENIZE_AHEAD]
                texts = [self.documents[i]["text"] for i in ids]
            for i, tokens in enumerate(self.tokenizer.encode(texts, self.add_bos)):
                self._cache[doc + i] = tokens
        return self._cache.get(doc)

    # -------------------------------------------------------------- reading

    def next_rows(self, rows: int) -> torch.Tensor | None:
        """The next ``rows`` sequences [rows, seq_len] (int64); under
        ``shuffle=False`` None once the documents run out."""
        want = rows * self.seq_len
        out: list[int] = []
        while len(out) < want:
            tokens = self._tokens(self.doc)
            if tokens is None:  # the share is done: the next epoch
                if not self.shuffle or (self.doc == 0 and self.offset == 0):
                    if not self.shuffle:
                        return None
                    raise ValueError(f"[data] rank {self.rank}'s share of the documents is empty")
                self.epoch, self.doc, self.offset = self.epoch + 1, 0, 0
                self._start_epoch()
                continue
            take = tokens[self.offset : self.offset + want - len(out)]
            out.extend(take)
            self.offset += len(take)
            if self.offset == len(tokens):
                self.doc, self.offset = self.doc + 1, 0
        return torch.tensor(out, dtype=torch.int64).view(rows, self.seq_len)

    def state(self) -> torch.Tensor:
        """Where the next sequence starts: (epoch, document, token)."""
        return torch.tensor([self.epoch, self.doc, self.offset], dtype=torch.int64)

    def load_state(self, state: torch.Tensor) -> None:
        self.epoch, self.doc, self.offset = (int(v) for v in state.tolist())
        self._start_epoch()
