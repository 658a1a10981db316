"""A checkpoint's byte-level BPE tokenizer as a tiktoken Encoding whose ids are HF's with add_special_tokens=False,
except on characters that HF's normaliser, tiktoken's regex and the `regex` package know from other Unicode versions
(marks and digits added since Unicode 10, code points unassigned in Python's; a fuzz of millions of strings found no
other difference)."""

import functools
import re
import unicodedata

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
GGUF_PATTERNS = {k: p for keys, p in (("gpt-2 mpt olmo", GPT2_PATTERN), ("llama-bpe llama3 llama-v3", LLAMA3_PATTERN),
                 ("smollm starcoder refact codeshell command-r", DIGITS_PATTERN)) for k in keys.split()}
PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]      # U2B: the byte each GPT-2 character is
U2B = {chr(b): b for b in PRINTABLE} | {chr(256 + n): b for n, b in enumerate(sorted(set(range(256)) - set(PRINTABLE)))}
# a regex group of `tokens`, leftmost-longest first as HF matches them: .split(text) = [text, token, ..., text]
_alternation = functools.lru_cache(lambda tokens: re.compile(
    "(" + ("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or "(?!)") + ")"))


class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding plus an HF tokenizer's steps before its BPE: cut out allowed special tokens and the added
    tokens (always matched), normalise the rest, drop bytes the vocabulary cannot spell. Not in encode_to_numpy."""

    def __init__(self, name, *, special_tokens, added=None, normalizer=None, **kw):   # kw: pat_str, mergeable_ranks
        self.added, self.normalizer = added or {}, normalizer
        self.unspellable = bytes(b for b in range(256) if bytes([b]) not in kw["mergeable_ranks"])
        super().__init__(name, special_tokens={**special_tokens, **self.added}, **kw)   # decode() knows both

    def __getstate__(self):
        return {**super().__getstate__(), "added": self.added, "normalizer": self.normalizer}

    def encode(self, text, *, allowed_special=frozenset(), disallowed_special="all"):
        """Token ids of `text`; special tokens as in tiktoken.Encoding.encode."""
        specials = self._special_tokens.keys() - self.added.keys()
        allowed = specials if allowed_special == "all" else specials & set(allowed_special)
        disallowed = specials - allowed if disallowed_special == "all" else specials & set(disallowed_special)
        if disallowed and (m := _alternation(frozenset(disallowed)).search(text)):
            raise ValueError(f"text contains the special token {m.group()!r}; allow it, or pass disallowed_special=()")
        parts = _alternation(frozenset(allowed | self.added.keys())).split(text)   # odd n: a special or added
        return [i for n, s in enumerate(parts) for i in ([self._special_tokens[s]] if n % 2 else self._encode_plain(s))]

    encode_ordinary = functools.partialmethod(encode, disallowed_special=())

    def _encode_plain(self, text):
        text = unicodedata.normalize(self.normalizer, text) if self.normalizer else text
        if set(text.encode("utf-8", "surrogatepass")).isdisjoint(self.unspellable):
            return super().encode_ordinary(text)
        import regex  # installed with tiktoken; the rare slow path drops unspellable bytes from each piece, as HF
        pieces = (p.encode("utf-8", "replace") for p in regex.findall(self._pat_str, text))
        return [i for q in pieces if (p := q.translate(None, self.unspellable)) for i in self._encode_single_piece(p)]


def _byte_level_bpe(name, vocab, merges, pat_str, specials=None, **kw):
    """A tiktoken Encoding of a byte-level BPE {token: id} and merges ["left right" or (left, right)], ids rising in
    merge order (tiktoken's ranks); specials=None: every token neither a byte nor merged; kw: added, normalizer."""
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    merged = [vocab[a + b] for a, b in pairs]
    ranks = {bytes(U2B[c] for c in t): vocab[t] for t in [*(vocab.keys() & U2B), *(a + b for a, b in pairs)]}
    if not vocab or not all(type(i) is int and 0 <= i < 2 ** 32 for d in (vocab, specials or {}, kw.get("added") or {})
                            for i in d.values()) or len(set(vocab.values())) < len(vocab) or merged != sorted(merged):
        raise ValueError("token ids not distinct whole numbers from 0 below 2^32, rising in merge order")
    specials = {t: vocab[t] for t in vocab.keys() - U2B - {*map("".join, pairs)}} if specials is None else specials
    return HFEncoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials, **kw)


def _read(p):
    """load_tokenizer's reading of a tokenizer.json (a BPE; pre-tokenizer ByteLevel, Digits + ByteLevel or Split(regex)
    + ByteLevel(use_regex=false)), GGUF file or folder of GPT-2's files; bad content: a ValueError, KeyError, ..."""
    if p.suffix.lower() == ".json":
        spec = read_json(p, "re-download the tokenizer files", dict)
        model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
        steps = (pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]) or [{}]
        kinds, first, last, norm = [s.get("type") for s in steps], steps[0], steps[-1], norm.get("type")
        regex, isolated = last.get("use_regex", True), first.get("behavior") == "Isolated" and not first.get("invert")
        pattern = {("ByteLevel",): regex and GPT2_PATTERN, ("Digits", "ByteLevel"): regex and first.get(
            "individual_digits") and DIGITS_PATTERN, ("Split", "ByteLevel"): not regex and isolated and (
            first.get("pattern") or {}).get("Regex")}.get(tuple(kinds))
        opts = [*filter(model.get, ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")),
                *filter(last.get, ["add_prefix_space"])]
        if model.get("type") != "BPE" or opts or norm not in (None, "NFC", "NFD", "NFKC", "NFKD") or not pattern:
            raise ValueError(f"model {model.get('type')!r}, normalizer {norm!r}, pre-tokenizer {kinds}, options {opts}")
        extra = spec.get("added_tokens") or []
        specials, added = ({t["content"]: t["id"] for t in extra if bool(t.get("special")) == s} for s in (True, False))
        return _byte_level_bpe(p.stem, model["vocab"], model.get("merges", []), pattern, specials=specials,
                               added=added, normalizer=norm)
    if p.is_file():   # GGUF: tokenizer.ggml.model "gpt2"; token type 3 = control: special, 4 = user-defined: added
        meta = open_gguf(str(p))[1]
        kind, pre = meta("tokenizer.ggml.model"), meta("tokenizer.ggml.pre", "default")
        if kind != "gpt2" or pre not in GGUF_PATTERNS:          # tokenizer.ggml.pre picks the regex, as in llama.cpp
            raise ValueError(f"tokenizer.ggml.model {kind!r}, tokenizer.ggml.pre {pre!r}")
        tokens, types = meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.token_type")
        specials, added = ({t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == k} for k in (3, 4))
        return _byte_level_bpe(meta("general.name", "gguf"), {t: i for i, t in enumerate(tokens)},
                               meta("tokenizer.ggml.merges"), GGUF_PATTERNS[pre], specials=specials, added=added)
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):   # GPT-2's files; merges.txt
        if (p / vocab).is_file() and (p / merges).is_file():                              # starts with '#version'
            lines = (p / merges).read_text(encoding="utf-8", errors="replace").splitlines()
            return _byte_level_bpe("gpt2", read_json(p / vocab, "re-download the tokenizer files", dict),
                                   [m for m in lines if m and not m.startswith("#version")], GPT2_PATTERN)
    raise ModelError(f"{p} holds no tokenizer.json, vocab.json + merges.txt or encoder.json + vocab.bpe, nor is a file")


def load_tokenizer(name_or_path) -> tiktoken.Encoding:
    """The tokenizer of what checkpoint.locate finds (a folder of tokenizer files, tokenizer.json first; a
    tokenizer.json or .gguf file; "smollm2-135m"; a hub id) as a tiktoken Encoding, or a ModelError."""
    p = locate(name_or_path, ["tokenizer.json", "vocab.json", "merges.txt"])
    p = p / "tokenizer.json" if (p / "tokenizer.json").is_file() else p
    try:
        return _read(p)
    except (LookupError, TypeError, AttributeError, ValueError) as e:
        raise ModelError(f"{p} is not a byte-level BPE tokenizer this loader reads ({type(e).__name__}: {e}); "
                         "re-download the tokenizer files if they are damaged") from None
