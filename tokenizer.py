"""A checkpoint's byte-level BPE tokenizer as a tiktoken Encoding whose ids are HF's with
add_special_tokens=False, except on characters that HF, tiktoken and `regex` know from other Unicode
versions (a fuzz of millions of strings found no other difference)."""

import functools
import re
import unicodedata

import tiktoken

import door
import files
from checkpoint import locate, open_gguf

# GPT-2's pre-tokenizer regex (HF's ByteLevel ends it `\s+(?!\S)|\s+`, which splits alike)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Each digit a piece (HF's Digits(individual_digits), llama.cpp's "smollm"); a digit ends a
# whitespace run like $ does.
DIGITS_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++|\p{N}| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?![^\s\p{N}])|\s"""
# Llama-3's (tiktoken's cl100k_base), llama.cpp's "llama-bpe"
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# llama.cpp's tokenizer.ggml.pre values (grouped as in llama-vocab.cpp) -> the regex splitting alike
GGUF_GROUPS = {"gpt-2 mpt olmo": GPT2_PATTERN,
               "llama-bpe llama3 llama-v3": LLAMA3_PATTERN,
               "smollm starcoder refact codeshell command-r": DIGITS_PATTERN}
GGUF_PATTERNS = {name: pattern for names, pattern in GGUF_GROUPS.items() for name in names.split()}
# U2B: the byte each of GPT-2's 256 byte characters stands for; the printable bytes are themselves
PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
SHIFTED = sorted(set(range(256)) - set(PRINTABLE))
U2B = {chr(b): b for b in PRINTABLE} | {chr(256 + n): b for n, b in enumerate(SHIFTED)}


@functools.lru_cache
def _alternation(tokens):
    """A regex group of `tokens`, leftmost-longest first as HF matches them: .split(text) = [text,
    token, ..., text]."""
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.compile("(" + ("|".join(re.escape(t) for t in longest_first) or "(?!)") + ")")


class HFEncoding(tiktoken.Encoding):
    """A tiktoken Encoding plus an HF tokenizer's steps before its BPE: cut out allowed special
    tokens and the added tokens (always matched), normalise the rest, drop bytes the vocabulary
    cannot spell. Not in encode_to_numpy."""

    def __init__(self, name, *, special_tokens, added=None, normalizer=None, **kw):
        self.added = added or {}
        self.normalizer = normalizer
        self.unspellable = bytes(b for b in range(256) if bytes([b]) not in kw["mergeable_ranks"])
        # decode() knows both
        super().__init__(name, special_tokens={**special_tokens, **self.added}, **kw)

    def __getstate__(self):
        return {**super().__getstate__(), "added": self.added, "normalizer": self.normalizer}

    def encode(self, text, *, allowed_special=frozenset(), disallowed_special="all"):
        """Token ids of `text`; special tokens as in tiktoken.Encoding.encode."""
        specials = self._special_tokens.keys() - self.added.keys()
        if allowed_special == "all":
            allowed_special = specials
        if disallowed_special == "all":
            disallowed_special = specials - set(allowed_special)
        allowed = specials & set(allowed_special)
        disallowed = specials & set(disallowed_special)
        m = disallowed and _alternation(frozenset(disallowed)).search(text)
        if m:
            raise ValueError(f"text contains the special token {m.group()!r}; allow it, or pass "
                             "disallowed_special=()")
        # the odd parts are the special and added tokens
        parts = _alternation(frozenset(allowed | self.added.keys())).split(text)
        ids = self._encode_plain(parts[0])
        for token, plain in zip(parts[1::2], parts[2::2]):
            ids.append(self._special_tokens[token])
            ids += self._encode_plain(plain)
        return ids

    encode_ordinary = functools.partialmethod(encode, disallowed_special=())

    def _encode_plain(self, text):
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        if set(text.encode("utf-8", "surrogatepass")).isdisjoint(self.unspellable):
            return super().encode_ordinary(text)
        # the rare slow path drops unspellable bytes from each piece, as HF does
        import regex  # installed with tiktoken
        ids = []
        for piece in regex.findall(self._pat_str, text):
            p = piece.encode("utf-8", "replace").translate(None, self.unspellable)
            if p:
                ids += self._encode_single_piece(p)
        return ids


def _byte_level_bpe(name, vocab, merges, pat_str, specials=None, **kw):
    """A tiktoken Encoding of a byte-level BPE {token: id} and merges ["left right" or (left,
    right)], ids rising in merge order (tiktoken's ranks); specials=None: every token neither a byte
    nor merged; kw: added, normalizer."""
    pairs = [m.split(" ") if isinstance(m, str) else m for m in merges]
    merged = [vocab[a + b] for a, b in pairs]
    tokens = [*(vocab.keys() & U2B), *(a + b for a, b in pairs)]
    ranks = {bytes(U2B[c] for c in t): vocab[t] for t in tokens}
    ids = [i for d in (vocab, specials or {}, kw.get("added") or {}) for i in d.values()]
    whole = all(type(i) is int and 0 <= i < 2 ** 32 for i in ids)
    if not vocab or not whole or len(set(vocab.values())) < len(vocab) or merged != sorted(merged):
        raise ValueError("token ids not distinct whole numbers from 0 below 2^32, rising in merge "
                         "order")
    if specials is None:
        specials = {t: vocab[t] for t in vocab.keys() - U2B - {*map("".join, pairs)}}
    return HFEncoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials, **kw)


def _read_tokenizer_json(p):
    """A tokenizer.json: a BPE whose pre-tokenizer is ByteLevel, Digits + ByteLevel, or Split(regex)
    + ByteLevel(use_regex=false); bad content: a ValueError, KeyError, ..."""
    spec = files.read_json(p, "re-download the tokenizer files")
    bpe = spec.get("model") or {}
    pre = spec.get("pre_tokenizer") or {}
    norm = (spec.get("normalizer") or {}).get("type")
    steps = (pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]) or [{}]
    kinds = tuple(s.get("type") for s in steps)
    first, last = steps[0], steps[-1]
    regex = last.get("use_regex", True)
    if kinds == ("ByteLevel",):
        pattern = regex and GPT2_PATTERN
    elif kinds == ("Digits", "ByteLevel"):
        pattern = regex and first.get("individual_digits") and DIGITS_PATTERN
    elif kinds == ("Split", "ByteLevel"):
        isolated = first.get("behavior") == "Isolated" and not first.get("invert")
        pattern = not regex and isolated and (first.get("pattern") or {}).get("Regex")
    else:
        pattern = None
    options = ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
    opts = [*filter(bpe.get, options), *filter(last.get, ["add_prefix_space"])]
    norms = (None, "NFC", "NFD", "NFKC", "NFKD")
    if bpe.get("type") != "BPE" or opts or norm not in norms or not pattern:
        raise ValueError(f"model {bpe.get('type')!r}, normalizer {norm!r}, pre-tokenizer "
                         f"{list(kinds)}, options {opts}")
    extra = spec.get("added_tokens") or []
    specials = {t["content"]: t["id"] for t in extra if bool(t.get("special"))}
    added = {t["content"]: t["id"] for t in extra if not bool(t.get("special"))}
    return _byte_level_bpe(p.stem, bpe["vocab"], bpe.get("merges", []), pattern,
                           specials=specials, added=added, normalizer=norm)


def _read_gguf(p):
    """A GGUF file's tokenizer: tokenizer.ggml.model "gpt2", whose tokenizer.ggml.pre picks the
    regex as in llama.cpp; token type 3 (control) is special, 4 (user-defined) added."""
    meta = open_gguf(str(p))[1]
    kind = meta("tokenizer.ggml.model")
    pre = meta("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in GGUF_PATTERNS:
        raise ValueError(f"tokenizer.ggml.model {kind!r}, tokenizer.ggml.pre {pre!r}")
    tokens = meta("tokenizer.ggml.tokens")
    types = meta("tokenizer.ggml.token_type")
    specials = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3}
    added = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 4}
    vocab = {t: i for i, t in enumerate(tokens)}
    return _byte_level_bpe(meta("general.name", "gguf"), vocab, meta("tokenizer.ggml.merges"),
                           GGUF_PATTERNS[pre], specials=specials, added=added)


def load_tokenizer(name_or_path) -> tiktoken.Encoding:
    """The tokenizer of what checkpoint.locate finds (a folder of tokenizer files, tokenizer.json
    first; a tokenizer.json or .gguf file; "smollm2-135m"; a hub id) as a tiktoken Encoding."""
    p = locate(name_or_path, ["tokenizer.json", "vocab.json", "merges.txt"])
    if (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    try:
        if p.suffix.lower() == ".json":
            return _read_tokenizer_json(p)
        if p.is_file():
            return _read_gguf(p)
        # GPT-2's files; merges.txt starts with '#version'
        for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
            if (p / vocab).is_file() and (p / merges).is_file():
                lines = (p / merges).read_text(encoding="utf-8", errors="replace").splitlines()
                pairs = [m for m in lines if m and not m.startswith("#version")]
                encoder = files.read_json(p / vocab, "re-download the tokenizer files")
                return _byte_level_bpe("gpt2", encoder, pairs, GPT2_PATTERN)
    except (LookupError, TypeError, AttributeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
        raise door.ModelError(f"{p} is not a byte-level BPE tokenizer this loader reads ({why}); "
                              "re-download the tokenizer files if they are damaged") from None
    raise door.ModelError(f"{p} holds no tokenizer.json, vocab.json + merges.txt or encoder.json + "
                          "vocab.bpe, nor is a file; copy the tokenizer files of the model's hub "
                          "checkpoint (tokenizer.json, or vocab.json and merges.txt) beside its "
                          "config.json")
