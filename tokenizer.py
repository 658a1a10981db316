"""A checkpoint's byte-level BPE tokenizer (vocab.json + merges.txt, tokenizer.json or a GGUF file's metadata) as a
tiktoken Encoding whose ids are Hugging Face's with add_special_tokens=False."""

import functools
import re
import unicodedata
from pathlib import Path

import tiktoken

from checkpoint import locate, open_gguf
from common import ModelError, read_json

# GPT-2's pre-tokenizer regex in tiktoken's form (HF's ByteLevel ends it with `\s+(?!\S)|\s+`, which splits alike).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Each digit a piece (HF's Digits(individual_digits), llama.cpp's "smollm"); a digit ends a whitespace run like $ does.
DIGITS_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?![^\s\p{N}])|\s"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")     # Llama-3's (tiktoken's cl100k_base), llama.cpp's "llama-bpe"
# llama.cpp's tokenizer.ggml.pre values (grouped as in its llama-vocab.cpp) -> the regex that splits text alike
GGUF_PATTERNS = {**dict.fromkeys(["gpt2", "mpt", "olmo"], GPT2_PATTERN),
                 **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "command-r"], DIGITS_PATTERN),
                 **dict.fromkeys(["llama-bpe", "llama3", "llama-v3"], LLAMA3_PATTERN)}
UTF8_BYTES = [b for b in range(256) if b not in (0xC0, 0xC1) and b < 0xF5]   # the bytes UTF-8 text can hold
PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]      # U2B: GPT-2's character for each byte
U2B = {chr(b): b for b in PRINTABLE} | {chr(256 + n): b for n, b in enumerate(sorted(set(range(256)) - set(PRINTABLE)))}
REFETCH = "re-download the tokenizer files"


@functools.lru_cache
def _alternation(tokens: frozenset) -> re.Pattern:
    """A regex group of `tokens`, leftmost-longest first as HF matches them: .split(text) = [text, token, ..., text]."""
    return re.compile("(" + ("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or "(?!)") + ")")


class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding plus an HF tokenizer's steps before its BPE: cut out allowed special tokens, normalise the
    rest, cut out added tokens, drop bytes the vocabulary cannot spell (8 in SmolLM2's). Not in encode_to_numpy."""

    def __init__(self, name, *, pat_str, mergeable_ranks, special_tokens, added_tokens=None, normalizer=None):
        self.specials, self.added_tokens, self.normalizer = special_tokens, added_tokens or {}, normalizer
        self.unspellable = bytes(b for b in UTF8_BYTES if bytes([b]) not in mergeable_ranks)
        super().__init__(name, pat_str=pat_str, mergeable_ranks=mergeable_ranks,   # added tokens too: decode()
                         special_tokens={**special_tokens, **self.added_tokens})   # knows them

    @property
    def special_tokens_set(self) -> set[str]:   # not the added tokens, which are always matched
        return set(self.specials)

    def __getstate__(self):
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
        ids, added = [], _alternation(frozenset(self.added_tokens))
        for n, part in enumerate(_alternation(frozenset(allowed)).split(text)):
            if n % 2:                                                          # a special token
                ids.append(self.specials[part])
                continue
            part = unicodedata.normalize(self.normalizer, part) if self.normalizer else part
            for m, piece in enumerate(added.split(part)):                      # odd m: an added token
                ids += [self.added_tokens[piece]] if m % 2 else self._encode_plain(piece)
        return ids

    def encode_ordinary(self, text):
        return self.encode(text, disallowed_special=())

    def _encode_plain(self, text: str) -> list[int]:
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw.translate(None, self.unspellable)) == len(raw):
            return super().encode_ordinary(text)
        import regex  # installed with tiktoken; the rare slow path drops unspellable bytes from each piece, as HF
        pieces = (p.encode("utf-8", "replace").translate(None, self.unspellable)
                  for p in regex.findall(self._pat_str, text))
        return [i for p in pieces if p for i in self._encode_single_piece(p)]


def _byte_level_bpe(name, vocab, merges, pat_str, where, *, specials=None, added=None, normalizer=None):
    """A tiktoken Encoding of a byte-level BPE {token: id} and merges ["left right" or (left, right)]; tiktoken's ranks
    are ids, so ids must rise in merge order. specials=None: every token neither a byte nor merged (<|endoftext|>)."""
    ids = [*vocab.values(), *(specials or {}).values(), *(added or {}).values()]
    if not vocab or not all(type(i) is int and 0 <= i < 2 ** 32 for i in ids) or len(set(vocab.values())) < len(vocab):
        raise ModelError(f"{where}'s token ids are not distinct whole numbers from 0 below 2^32; {REFETCH}")
    try:
        ranks = {bytes([U2B[t]]): i for t, i in vocab.items() if len(t) == 1 and t in U2B}
        pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
        merged = [vocab[a + b] for a, b in pairs]
        ranks.update({bytes(U2B[c] for c in a + b): i for (a, b), i in zip(pairs, merged)})
    except (KeyError, ValueError, TypeError) as e:
        raise ModelError(f"{where} is not a consistent byte-level BPE tokenizer ({e!r}); {REFETCH}") from None
    if any(i >= j for i, j in zip(merged, merged[1:])):
        raise ModelError(f"{where} numbers its tokens out of merge order, which a tiktoken Encoding cannot express")
    made = set(ranks.values())
    specials = {t: i for t, i in vocab.items() if i not in made} if specials is None else specials
    return HFEncoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials,
                      added_tokens=added, normalizer=normalizer)


def _tokenizer_json(path: Path) -> tiktoken.Encoding:
    """A Hugging Face tokenizer.json of a byte-level BPE whose pre-tokenizer is ByteLevel (GPT-2's regex), Digits +
    ByteLevel (SmolLM2) or Split(regex) + ByteLevel(use_regex=false) (Llama-3, Qwen2)."""
    spec = read_json(path, REFETCH, dict)
    model = spec["model"] if isinstance(spec.get("model"), dict) else {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelError(f"{path} is not a byte-level BPE tokenizer.json (its model type is {model.get('type')!r}); "
                         "only BPE tokenizers such as GPT-2's or Pythia's are supported")
    if any(not isinstance(spec.get(k) or {}, dict) for k in ("normalizer", "pre_tokenizer")):
        raise ModelError(f"{path}'s normalizer or pre_tokenizer is not a JSON object; {REFETCH}")
    norm = (spec.get("normalizer") or {}).get("type")
    opts = [k for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback") if model.get(k)]
    if opts or norm not in (None, "NFC", "NFD", "NFKC", "NFKD"):
        raise ModelError(f"{path} uses BPE options this loader does not support ({', '.join(opts or [norm])})")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds, first, last = [step.get("type") for step in steps], (steps or [{}])[0], (steps or [{}])[-1]
    regex, isolated = last.get("use_regex", True), first.get("behavior") == "Isolated" and not first.get("invert")
    split = not regex and isolated and (first.get("pattern") or {}).get("Regex")   # Llama-3, Qwen2
    pattern = {("ByteLevel",): regex and GPT2_PATTERN, ("Split", "ByteLevel"): split,
               ("Digits", "ByteLevel"): regex and first.get("individual_digits") and DIGITS_PATTERN}.get(tuple(kinds))
    if not pattern or last.get("add_prefix_space"):
        raise ModelError(f"{path} has a pre-tokenizer this loader does not support ({' + '.join(map(str, kinds))}); "
                         "supported: ByteLevel, Digits + ByteLevel, Split + ByteLevel, all without add_prefix_space")
    try:
        extra = spec.get("added_tokens") or []
        specials, added = ({t["content"]: t["id"] for t in extra if bool(t.get("special")) == s} for s in (True, False))
    except (KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"{path}'s added_tokens are malformed ({e!r}); {REFETCH}") from None
    return _byte_level_bpe(path.stem, model["vocab"], model.get("merges", []), pattern, str(path),
                           specials=specials, added=added, normalizer=norm)


def _gguf_tokenizer(path) -> tiktoken.Encoding:
    """A GGUF file's byte-level BPE (tokenizer.ggml.model "gpt2"): tokens, merges, token types (3 = control:
    special; 4 = user-defined: matched whole) and tokenizer.ggml.pre, which picks the regex as llama.cpp does."""
    meta = open_gguf(path)[1]
    if (kind := meta("tokenizer.ggml.model")) != "gpt2":
        raise ModelError(f"{path} holds a {kind!r} tokenizer; only byte-level BPE (\"gpt2\") ones are supported")
    if (pre := meta("tokenizer.ggml.pre", "default")) not in GGUF_PATTERNS:
        raise ModelError(f"{path} uses the pre-tokenizer {pre!r}; supported: {', '.join(GGUF_PATTERNS)}")
    tokens, types = meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.token_type")
    specials, added = ({t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == k} for k in (3, 4))
    return _byte_level_bpe(meta("general.name", "gguf"), {t: i for i, t in enumerate(tokens)},
                           meta("tokenizer.ggml.merges"), GGUF_PATTERNS[pre], path, specials=specials, added=added)


def load_tokenizer(name_or_path) -> tiktoken.Encoding:
    """The tokenizer of what checkpoint.locate finds (a folder of tokenizer files, tokenizer.json first; a
    tokenizer.json or .gguf file; "smollm2-135m"; a hub id) as a tiktoken Encoding, or a ModelError."""
    p = locate(name_or_path, ["tokenizer.json", "vocab.json", "merges.txt"])
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if p.is_file():                                         # a file: tokenizer.json, else GGUF (as read_checkpoint)
        return _tokenizer_json(p) if p.suffix.lower() == ".json" else _gguf_tokenizer(str(p))
    for vocab, merges_txt in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (p / vocab).is_file() and (p / merges_txt).is_file():  # GPT-2's files; '#version' starts merges.txt
            lines = (p / merges_txt).read_text(encoding="utf-8", errors="replace").splitlines()
            merges = [line for line in lines if line and not line.startswith("#version")]
            return _byte_level_bpe("gpt2", read_json(p / vocab, REFETCH, dict), merges, GPT2_PATTERN, str(p))
    raise ModelError(f"{p} holds no tokenizer files; it needs tokenizer.json, vocab.json + merges.txt or encoder.json "
                     "+ vocab.bpe (or pass a tokenizer.json or .gguf file)")
