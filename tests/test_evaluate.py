"""evaluate.py: prompts and scoring exactly as the lm-evaluation-harness, perplexity, speed, torchrun shares and
bad input."""

import json
import math
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import checkpoint
import datafiles
import devices
import door
import evaluate
import fast_scorer
import model
import tasks
from conftest import EVAL, N_POS, ROOT, TOK, WIKITEXT, edit_json, script_env, snapshot, torchrun
from model import GPT
from tokenizer import load_tokenizer

# ==================================================================================================================
# evaluate.py: harness-exact scoring, perplexity, speed, bad input

@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' GPT-2 tokenizer (what the harness uses), built as transformers 5 wants it."""
    from transformers import GPT2Tokenizer
    vocab = json.loads((TOK / "encoder.json").read_text())
    merges = [tuple(line.split()) for line in (TOK / "vocab.bpe").read_text().splitlines()[1:] if line]
    return GPT2Tokenizer(vocab=vocab, merges=merges)


def load_task(name, *args):
    """A task's prompts: its documents read by tasks.py, made prompts by evaluate.py's function."""
    return tasks.load_task(name, evaluate.TASKS[name], *args)


def first(task, n=1):
    return load_task(task, EVAL, n)[n - 1]


def test_prompt_piqa():
    p = first("piqa")
    ctx = "Question: To fight Ivan Drago in Rocky for sega master system.\nAnswer:"
    assert p.requests == [(ctx, " Drago isn't in this game because it was released before Rocky IV."),
                          (ctx, " You have to defeat Apollo Creed and Clubber Lang first.")]
    assert p.gold == 1
    assert p.choices == ["Drago isn't in this game because it was released before Rocky IV.",
                         "You have to defeat Apollo Creed and Clubber Lang first."]


def test_prompt_arc():
    p = first("arc_easy")
    ctx = "Question: Which best describes the structure of an atom?\nAnswer:"
    assert p.requests == [(ctx, " a lightweight core surrounded by neutral particles"),
                          (ctx, " a massive core surrounded by negatively-charged particles"),
                          (ctx, " a network of interacting positive and negative particles"),
                          (ctx, " overlapping layers of neutral, positive, and negative particles")]
    assert p.gold == 1 and len(p.choices) == 4
    p = first("arc_challenge")
    assert p.requests[2] == ("Question: The end result in the process of photosynthesis is the production of sugar "
                             "and oxygen. Which step signals the beginning of photosynthesis?\nAnswer:",
                             " Chlorophyll in the leaf captures light energy.")
    assert p.gold == 2
    # answerKey "1".."4" and 3 or 5 choices occur in ARC: the gold is the answerKey's place among the labels
    doc = {"question": "q", "choices": {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}, "answerKey": "3"}
    assert evaluate.arc(doc).gold == 2 and len(evaluate.arc(doc).requests) == 3


def test_prompt_logiqa():
    p = first("logiqa")
    ctx = ("Passage: The company sent three young staff members to the South for business trip. The three of them "
           "happened to be sitting in a row. At least one of the two people sitting on the right side of 24 years old "
           "was 20 years old. 20 years old. At least one of the two people sitting on the left of the accountant is a "
           "salesperson, and one of the two people sitting on the right of the salesperson is also a salesperson.\n"
           "Question: So what are the three young people on business?\n"
           "Choices:\n"
           "A. 20-year-old accountant, 20-year-old salesperson, 24-year-old salesperson\n"
           "B. 20-year-old accountant, 24-year-old salesperson, 24-year-old salesperson\n"
           "C. 24-year-old accountant, 20-year-old salesperson, 20-year-old salesperson\n"
           "D. 20-year-old accountant, 20-year-old accountant, 24-year-old salesperson\n"
           "Answer:")
    assert [c for c, _ in p.requests] == [ctx] * 4
    assert p.requests[3][1] == " 20-year-old accountant, 20-year-old accountant, 24-year-old salesperson"
    assert p.gold == 0 and len(p.choices) == 4


def test_prompt_mmlu():
    p = first("mmlu")
    ctx = ("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
           "The set of all real numbers under the usual multiplication operation is not a group since\n"
           "A. multiplication is not a binary operation\n"
           "B. multiplication is not associative\n"
           "C. identity element does not exist\n"
           "D. zero has no inverse\n"
           "Answer:")
    assert p.requests == [(ctx, " A"), (ctx, " B"), (ctx, " C"), (ctx, " D")]
    assert p.gold == 3 and p.choices is None and p.group == "abstract_algebra"  # MMLU has acc only


def test_prompt_winogrande():
    p = first("winogrande")
    assert p.requests == [("They were worried the wine would ruin the bed and the blanket, but the blanket",
                           " was't ruined."),
                          ("They were worried the wine would ruin the bed and the blanket, but the bed",
                           " was't ruined.")]
    assert p.gold == 1 and p.choices is None


def test_prompt_wsc273():
    p = first("wsc273")
    # the option is lowercased mid-sentence; the target keeps its own leading space after the " " delimiter
    assert p.requests == [("The city councilmen refused the demonstrators a permit because the city councilmen",
                           "  feared violence."),
                          ("The city councilmen refused the demonstrators a permit because the demonstrators",
                           "  feared violence.")]
    assert p.gold == 0 and p.choices is None
    # possessive pronoun: the harness appends 's to every option, even one that already has it
    text = "The man ran. He fell."                      # a pronoun that starts a sentence: the option as it is
    doc = {"text": text, "pronoun": "He", "pronoun_loc": 13, "options": ["The man", "The dog"], "label": 0}
    assert evaluate.wsc273(doc).requests == [("The man ran. The man", "  fell."), ("The man ran. The dog", "  fell.")]
    p = first("wsc273", 74)
    assert p.requests == [("Emma's mother had died long ago, and Emma's's",
                           "  place had been taken by an excellent woman as governess."),
                          ("Emma's mother had died long ago, and Emma's mother's",
                           "  place had been taken by an excellent woman as governess.")]


def test_every_document_loads():
    for task in tasks.ALL_TASKS:
        prompts = load_task(task, EVAL)
        assert len(prompts) == 100
        assert all(0 <= p.gold < len(p.requests) for p in prompts)


def test_encode_pair_whitespace_rule(enc):
    assert evaluate.encode_pair(enc, "Hello", " world") == ([15496], [995])
    # trailing whitespace of the context moves onto the continuation: "Hello " + "world" scores " world"
    assert evaluate.encode_pair(enc, "Hello ", "world") == ([15496], [995])
    # continuation tokens are the whole string's tokens beyond the context's, not tokens(continuation): they differ
    # where BPE merges across the boundary ("34 apples" is [2682, 22514]; "4 apples" alone would be [19, 22514])
    ctx, cont = evaluate.encode_pair(enc, "Answer:", " A")
    assert ctx == [33706, 25] and cont == [317]
    assert enc.encode("34 apples") == [2682, 22514] and evaluate.encode_pair(enc, "3", "4 apples") == ([18], [22514])
    assert evaluate.encode_pair(enc, "a<|endoftext|>", " b") == ([64, 50256], [275])  # a special token's text: its id


def hf_encode_pair(hf_tok, context, continuation):
    """The harness's _encode_pair written out again, with transformers' tokenizer."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = hf_tok.encode(context + continuation), hf_tok.encode(context)
    return ctx, whole[len(ctx):]


def test_encode_pair_matches_hf_tokenizer(enc, hf_tok):
    """The harness's _encode_pair with transformers' tokenizer, on every request of the first 10 documents."""
    n = 0
    for task in tasks.ALL_TASKS:
        for p in load_task(task, EVAL, 10):
            for c, t in p.requests:
                assert evaluate.encode_pair(enc, c, t) == hf_encode_pair(hf_tok, c, t), (task, c, t)
                n += 1
    assert n > 150


def test_harness_window():
    # (ctx + cont)[-(L+1):][:-1]: left-truncated, last token dropped; the last len(cont) positions are scored
    inp, targets = evaluate.harness_window(list(range(10)), [10, 11], 5)
    assert inp == [6, 7, 8, 9, 10] and targets == [(3, 10), (4, 11)]
    inp, targets = evaluate.harness_window([1, 2], [3], 5)
    assert inp == [1, 2] and targets == [(1, 3)]
    inp, targets = evaluate.harness_window([1], [2, 3, 4, 5, 6], 5)   # a continuation as long as the context
    assert inp == [1, 2, 3, 4, 5] and targets == [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]
    with pytest.raises(door.ModelError, match=r"^a request with an empty context cannot be scored as the harness"):
        tasks.check_requests([[([], [3, 4])]], 5)                     # its first target would be read at position -1


def tokenized(enc, prompts):
    """Every request of every document as (context tokens, continuation tokens)."""
    return [[evaluate.encode_pair(enc, c, t) for c, t in p.requests] for p in prompts]


def naive_loglikelihood(logits_of, ctx_tokens, cont_tokens):
    """The harness's rule written out again, apart from evaluate.py: feed (ctx + cont)[-(L+1):][:-1] to a model
    (logits_of: ids (1, T) -> logits (1, T, V)), add the log-softmax of each continuation token at the position
    before it; greedy if every one is the argmax there."""
    full = (ctx_tokens + cont_tokens)[-(N_POS + 1):]
    with torch.no_grad():
        logp = F.log_softmax(logits_of(torch.tensor([full[:-1]]))[0].float(), -1)
    rows = list(zip(logp[len(full) - 1 - len(cont_tokens):], cont_tokens))
    return sum(float(r[t]) for r, t in rows), all(int(r.argmax()) == t for r, t in rows)


def test_every_scorer_equals_a_naive_transformers_computation(tiny_gpt, enc, hf_model):
    """--plain (one forward pass per request), the default fast scorer, and the fast scorer without shared prefixes
    (LM head at scored positions only), each against transformers' model on the window written out in the test:
    log-likelihoods within fp32 noise, the same is_greedy, the same acc and acc_norm, on 4 documents of every task."""
    from fast_scorer import score_windows
    worst, n = 0.0, 0
    for task in tasks.ALL_TASKS:
        prompts = load_task(task, EVAL, 4)
        docs = tokenized(enc, prompts)
        windows = [[evaluate.harness_window(c, t, N_POS) for c, t in doc] for doc in docs]
        scorers = {"plain": evaluate.score_requests(tiny_gpt, docs, plain=True),
                   "fast": evaluate.score_requests(tiny_gpt, docs, 4),
                   "unshared": score_windows(tiny_gpt, windows, batch_size=3, share_prefix=False)}
        for d, (doc, p) in enumerate(zip(docs, prompts)):
            naive = [naive_loglikelihood(lambda x: hf_model(x).logits, c, t) for c, t in doc]
            for name, scored in scorers.items():
                worst = max([worst] + [abs(a - b) for (a, _), (b, _) in zip(naive, scored[d])])
                assert [g for _, g in scored[d]] == [g for _, g in naive], (task, name)
                assert (evaluate.doc_metrics([ll for ll, _ in scored[d]], p.gold, p.choices) ==
                        evaluate.doc_metrics([ll for ll, _ in naive], p.gold, p.choices)), (task, name)
            n += len(doc)
    assert worst < 1e-4, worst
    assert n > 80


def test_every_scorer_on_a_linear_student(enc, ckpt):
    """The cached-prefix path also holds for a linearised student (recurrent state instead of a KV cache): plain and
    fast against the naive sum over the student's own full forward pass."""
    torch.manual_seed(0)
    student = GPT.from_pretrained(ckpt).linearize([8, 8], chunk_size=16)
    docs = tokenized(enc, load_task("arc_easy", EVAL, 2) + load_task("wsc273", EVAL, 2))
    naive = [[naive_loglikelihood(lambda x: student(x), c, t)[0] for c, t in doc] for doc in docs]
    for plain in (False, True):
        for ref, res in zip(naive, evaluate.score_requests(student, docs, batch_size=3, plain=plain), strict=True):
            assert [ll for ll, _ in res] == pytest.approx(ref, abs=1e-3)


def test_is_greedy_needs_every_continuation_token_to_be_the_argmax(tiny_gpt, hf_model):
    """A two-token continuation whose first token is not transformers' argmax and whose second is: not greedy, in
    every scorer (a scorer that kept the last token's verdict would say greedy); both argmaxes: greedy."""
    from fast_scorer import score_windows
    ctx = [464, 2068, 7586, 21831]
    with torch.no_grad():
        first = hf_model(torch.tensor([ctx])).logits[0, -1].argmax().item()
        other = (first + 1) % 50257
        after = [hf_model(torch.tensor([ctx + [t]])).logits[0, -1].argmax().item() for t in (first, other)]
    docs = [[(ctx, [other, after[1]]), (ctx, [first, after[0]])]]
    windows = [[evaluate.harness_window(c, t, N_POS) for c, t in doc] for doc in docs]
    for res in (evaluate.score_requests(tiny_gpt, docs, plain=True), evaluate.score_requests(tiny_gpt, docs, 2),
                score_windows(tiny_gpt, windows, batch_size=1, share_prefix=False)):
        assert [g for _, g in res[0]] == [False, True]


def test_a_continuation_as_long_as_the_context_is_scored_and_one_token_longer_is_refused(tiny_gpt, hf_model):
    """The boundary of check_requests: a continuation of exactly the model's 128 positions fills the whole window
    (its first token is predicted at position 0, from the context's last token) and every scorer gives transformers'
    sum; 129 tokens cannot be scored (the first would have nothing before it) and are refused."""
    ctx, cont = [464, 2068], [(7919 * i) % 50257 for i in range(1, N_POS + 1)]
    tasks.check_requests([[(ctx, cont)]], N_POS)                                   # accepted: no error
    naive = naive_loglikelihood(lambda x: hf_model(x).logits, ctx, cont)
    for plain in (False, True):
        [[(ll, greedy)]] = evaluate.score_requests(tiny_gpt, [[(ctx, cont)]], plain=plain)
        assert ll == pytest.approx(naive[0], rel=1e-5) and greedy == naive[1]
    with pytest.raises(door.ModelError, match=f"^a continuation of {N_POS + 1} tokens cannot be scored: it needs 1 to "
                                              f"{N_POS}, the model's context length$"):
        tasks.check_requests([[(ctx, cont + [13])]], N_POS)


def test_a_row_that_is_the_prefix_of_another_keeps_a_token_of_its_own(tiny_gpt):
    """Choices " x" and " x y" after one context: the first row's tokens all begin the second's; the shared prefix
    stops a token short of the shorter row (it must keep one to score), and every scorer gives the plain scores."""
    from fast_scorer import score_windows
    docs = [[([464, 2068, 7586], [21831]), ([464, 2068, 7586], [21831, 18045, 625])]]
    windows = [[evaluate.harness_window(c, t, N_POS) for c, t in doc] for doc in docs]
    plain = evaluate.score_requests(tiny_gpt, docs, plain=True)
    for res in (evaluate.score_requests(tiny_gpt, docs, 2),
                score_windows(tiny_gpt, windows, batch_size=1, share_prefix=True)):
        assert [ll for ll, _ in res[0]] == pytest.approx([ll for ll, _ in plain[0]], abs=1e-4)


def test_truncation_like_the_harness(tiny_gpt, enc, hf_model):
    """A context longer than the model's 128 positions is cut from the left, to the last 129 tokens minus one."""
    context = " ".join(f"word{i}" for i in range(200))
    ctx, cont = evaluate.encode_pair(enc, context, " the end of it")
    assert len(ctx) > 2 * N_POS
    for plain in (False, True):
        [[(ll, _)]] = evaluate.score_requests(tiny_gpt, [[(ctx, cont)]], plain=plain)
        assert abs(ll - naive_loglikelihood(lambda x: hf_model(x).logits, ctx, cont)[0]) < 1e-4


def test_acc_norm_divides_by_choice_characters():
    # acc picks the higher log-likelihood; acc_norm divides by len(choice) without the " " delimiter:
    # -3/1 < -5/2, so choice 1 wins (with the delimiter counted it would be -3/2 > -5/3: choice 0)
    assert evaluate.doc_metrics([-3.0, -5.0], 1, ["a", "bb"]) == (0.0, 1.0)
    assert evaluate.doc_metrics([-3.0, -5.0], 0, ["a", "bb"]) == (1.0, 0.0)
    assert evaluate.doc_metrics([-3.0, -5.0], 0, None) == (1.0, None)
    # characters, as the harness's len(str), not UTF-8 bytes: "é" is 1 character (-3/1 < -5/2) but 2 bytes (-3/2)
    assert evaluate.doc_metrics([-3.0, -5.0], 1, ["\u00e9", "ab"]) == (0.0, 1.0)


def test_ties_go_to_the_first():
    assert evaluate.doc_metrics([-1.0, -1.0], 0, ["x", "y"]) == (1.0, 1.0)
    assert evaluate.doc_metrics([-1.0, -1.0], 1, ["x", "y"]) == (0.0, 0.0)


def test_stderr_by_hand_and_pooled_stderr_by_the_law_of_total_variance(monkeypatch):
    """The stderr on values worked out by hand; MMLU's pooled stderr also by an independent route: the pooled
    within-subject variance from the raw values, total minus between-subject sum of squares; evaluate_task pools
    acc's by the prompts' subjects."""
    # mean 3/4, squares 3/4, / 3 = 1/4: sqrt / sqrt 4
    assert evaluate.stderr([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.25)
    assert evaluate.stderr([1.0, 0.0]) == pytest.approx(0.5)  # the fewest values with one: sqrt(1/2) / sqrt 2
    assert evaluate.stderr([1.0]) is None                                 # the harness says N/A
    # a = 1 0 1 (mean 2/3, squares 2/3) and b = 0 0 1 1 (mean 1/2, squares 1): within 5/3 over 7 - 2, / 7 = 1/21
    assert evaluate.stderr([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0], list("aaabbbb")) == pytest.approx(math.sqrt(1 / 21))
    accs = [1, 0, 1, 0, 0, 1, 1]                                   # the same, as the scores of two-choice prompts
    monkeypatch.setattr(evaluate, "score_requests",
                        lambda *a: [[(-1.0, False), (-2.0 if x else -0.5, False)] for x in accs])
    enc = types.SimpleNamespace(encode=lambda text, **k: [ord(c) for c in text])
    prompts = [evaluate.Prompt([("q", " A"), ("q", " B")], 0, None, g) for g in "aaabbbb"]
    result, samples = evaluate.evaluate_task(None, enc, prompts, evaluate.EvalConfig(device="cpu"))
    assert [d["acc"] for d in samples] == accs and result["acc_stderr"] == pytest.approx(math.sqrt(1 / 21))
    rng = np.random.default_rng(0)
    xs, groups = rng.integers(0, 2, 300).astype(float), rng.integers(0, 7, 300)
    between = sum((groups == g).sum() * (xs[groups == g].mean() - xs.mean()) ** 2 for g in range(7))
    within = len(xs) * xs.var() - between
    assert evaluate.stderr(list(xs), list(groups)) == pytest.approx(math.sqrt(within / (len(xs) - 7) / len(xs)))
    # a subject with one question (N/A in the harness, e.g. under --limit): the stderr over all questions instead
    assert evaluate.stderr([1.0, 0.0, 1.0, 1.0], list("aaab")) == evaluate.stderr([1.0, 0.0, 1.0, 1.0])


def evaluate_cli(*args):
    """evaluate.py's main in-process on the CPU (the default, auto, would take a GPU and bf16 where there is one)."""
    return evaluate.main(["--device", "cpu", *map(str, args)])


def test_cli_results_json(ckpt, tmp_path, capsys):
    torch.manual_seed(0)
    out = tmp_path / "results.json"
    evaluate_cli("--model", ckpt, "--tasks", "all", "--data-dir", EVAL, "--limit", 2, "--batch-size", 4,
                 "--output", out, "--ppl", WIKITEXT, "--ppl-max-tokens", 300, "--speed", "--speed-tokens", 20)
    printed = capsys.readouterr().out
    assert "piqa" in printed and "acc_norm" in printed and "perplexity" in printed and "prefill" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no .tmp left beside it
    r = json.loads(out.read_text())
    assert list(r["results"]) == list(tasks.ALL_TASKS)
    for task in tasks.ALL_TASKS:
        res, samples = r["results"][task], r["samples"][task]
        assert res["n"] == 2 and {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(res)
        assert [s["doc_index"] for s in samples] == [0, 1]
        prompts = load_task(task, EVAL, 2)
        for s, p in zip(samples, prompts):
            assert [tuple(q) for q in s["requests"]] == p.requests
            assert len(s["loglikelihoods"]) == len(p.requests) and s["gold"] == p.gold
            assert (s["acc_norm"] is None) == (p.choices is None)
        assert res["acc"] == pytest.approx(sum(s["acc"] for s in samples) / 2)
    assert r["ppl"]["teacher"]["tokens"] == 299 and r["ppl"]["teacher"]["loss"] > 0
    assert r["speed"]["teacher"]["tokens"] == 20 and r["config"]["device"] == "cpu"


def test_cli_plain_and_default_write_the_naive_log_likelihoods(ckpt, hf_model, hf_tok, tmp_path, monkeypatch):
    """--plain (one full forward pass per request) and the default shared-prefix scorer each write the
    log-likelihoods of transformers' tokenizer and model on the harness's window (written out in the test) within
    fp32 noise, the same is_greedy, and equal acc / acc_norm and results."""
    args = ["--model", ckpt, "--tasks", "all", "--data-dir", EVAL, "--limit", 3, "--batch-size", 4]
    evaluate_cli(*args, "--output", tmp_path / "fast.json")
    monkeypatch.setattr(fast_scorer, "score_windows", None)  # --plain must not reach the shared-prefix scorer
    evaluate_cli(*args, "--output", tmp_path / "plain.json", "--plain")
    fast, plain = (json.loads((tmp_path / f).read_text()) for f in ("fast.json", "plain.json"))
    assert plain["config"]["plain"] and not fast["config"]["plain"]
    for task in tasks.ALL_TASKS:
        for key in ("n", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
            assert plain["results"][task][key] == fast["results"][task][key], (task, key)
        for p, f in zip(plain["samples"][task], fast["samples"][task], strict=True):
            naive = [naive_loglikelihood(lambda x: hf_model(x).logits, *hf_encode_pair(hf_tok, c, t))
                     for c, t in p["requests"]]
            for s in (p, f):
                assert s["loglikelihoods"] == pytest.approx([ll for ll, _ in naive], abs=1e-4)
                assert s["is_greedy"] == [g for _, g in naive]
            assert (p["acc"], p["acc_norm"]) == (f["acc"], f["acc_norm"])


def test_ppl_max_tokens_are_the_first_tokens_of_the_whole_file(enc, tmp_path):
    """--ppl-max-tokens N on a text file: the first N tokens of the whole file's encoding, also where a token is
    longer than the 16 characters a token first gets (the prefix that is encoded grows until it holds N)."""
    for i, text in enumerate([("#" * 80 + "\n") * 200, WIKITEXT.read_text(encoding="utf-8")[:20000]]):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
        full = enc.encode_ordinary(text)
        for n in (10, 100, len(full) - 1):
            assert datafiles.read_tokens(tmp_path / f"{i}.txt", enc, n).tolist() == full[:n], (i, n)
    text = "".join("#" * (40 + 7 * i % 50) + "\n" for i in range(60))          # cuts inside many-token words
    (tmp_path / "runs.txt").write_text(text, encoding="utf-8")
    full = enc.encode_ordinary(text)
    assert all(datafiles.read_tokens(tmp_path / "runs.txt", enc, n).tolist() == full[:n] for n in range(1, len(full)))


def test_token_files_of_a_tokenizer_of_the_same_size_are_refused_by_the_probe(enc, tmp_path):
    """meta.json's probe ids, not only its vocabulary size, identify the tokenizer (GPT-2's and another of 50,257);
    it is read in the folder, beside a .bin, never beside text (encoded with enc), and need=True requires it."""
    probe, data = "Hello world! 13 dogs.", tmp_path / "data"
    meta = {"tokenizer": {"model": "other", "n_vocab": enc.n_vocab, "probe": probe, "probe_ids": enc.encode_ordinary(
        probe)}}
    assert datafiles.check_tokenizer(data, enc, "gpt2") is None and data.mkdir() is None
    with pytest.raises(door.ModelError, match=r"^\S+meta.json does not exist; prepare them again$"):
        datafiles.check_tokenizer(data, enc, "gpt2", "prepare them again", need=True)
    (data / "meta.json").write_text(json.dumps(meta))
    assert datafiles.check_tokenizer(data, enc, "gpt2") == datafiles.check_tokenizer(data / "val.bin", enc, "gpt2") == meta
    meta["tokenizer"]["probe_ids"] = meta["tokenizer"]["probe_ids"][::-1]
    (data / "meta.json").write_text(json.dumps(meta))
    assert datafiles.check_tokenizer(data / "text.txt", enc, "gpt2") is None
    for path in (data, data / "val.bin"):
        with pytest.raises(door.ModelError, match=r"^\S+ was tokenized with the tokenizer of other \(50257 tokens\), not "
                                             r"gpt2's \(50257\); prepare them again$"):
            datafiles.check_tokenizer(path, enc, "gpt2", "prepare them again")
    (data / "meta.json").write_text(json.dumps({"tokenizer": "gpt2"}))          # a name, not prepare.py's record
    with pytest.raises(door.ModelError, match=r"^\S+ was tokenized with the tokenizer of \? \(.*\), not gpt2's \(50257\)"):
        datafiles.check_tokenizer(data, enc, "gpt2")


def test_ppl_refuses_token_files_of_another_tokenizer(ckpt, enc, tmp_path, capsys):
    """A .bin whose meta.json (prepare.py's record) names another tokenizer is one sentence, as in distill.py; with
    this model's record it is scored."""
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    meta = {"tokenizer": datafiles.data_script("text").tokenizer_meta(enc, ckpt)}
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": {**meta["tokenizer"], "n_vocab": 49152}}))
    code, err = evaluate_exit(capsys, "--model", ckpt, "--ppl", tmp_path / "val.bin")
    assert code == 2 and f"val.bin was tokenized with the tokenizer of {ckpt} (49152 tokens), not {ckpt}'s" in err
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    evaluate_cli("--model", ckpt, "--ppl", tmp_path / "val.bin")
    assert "ppl teacher: loss" in capsys.readouterr().out


def test_ppl_bin_without_meta_json_is_scored_with_one_warning_line(ckpt, enc, tmp_path, capsys):
    """A .bin without prepare.py's meta.json beside it cannot be checked against the tokenizer: it is scored (other
    tools write such files; the vocabulary bound still holds) after one warning line that says so; beside its
    meta.json, no warning."""
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    evaluate_cli("--model", ckpt, "--ppl", tmp_path / "val.bin")
    out, err = capsys.readouterr()
    assert "ppl teacher: loss" in out
    assert [line for line in err.splitlines() if "warning" in line] == [
        f"warning: {tmp_path / 'val.bin'} has no meta.json beside it: its tokens are read as ids of {ckpt}'s "
        "tokenizer, unchecked (data/*/prepare.py writes one)"]
    meta = {"tokenizer": datafiles.data_script("text").tokenizer_meta(enc, ckpt)}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    evaluate_cli("--model", ckpt, "--ppl", tmp_path / "val.bin")
    out, err = capsys.readouterr()
    assert "ppl teacher: loss" in out and "warning" not in err


def test_a_teacher_whose_perplexity_is_not_finite_ends_the_run_with_one_sentence(ckpt, tmp_path, capsys):
    """A teacher whose config makes every loss NaN (a negative layer-norm epsilon: the square root of a negative
    variance) is one sentence and exit code 2, not a NaN perplexity written with exit code 0."""
    shutil.copytree(ckpt, bad := tmp_path / "nan-teacher")
    edit_json(bad / "config.json", layer_norm_epsilon=-1e9)
    (tmp_path / "t.txt").write_text(WIKITEXT.read_text(encoding="utf-8")[:2000])
    code, err = evaluate_exit(capsys, "--model", bad, "--ppl", tmp_path / "t.txt", "--output", tmp_path / "r.json")
    assert code == 2 and err.splitlines()[-1] == (
        f"error: the teacher {bad} has a perplexity of nan on --ppl {tmp_path / 't.txt'} (mean loss nan): its weights "
        "or config are broken; check them, or pass another --model")
    assert not (tmp_path / "r.json").exists()


def test_ppl_text_keeps_special_tokens(enc, tmp_path):
    """--ppl encodes a text file as the tasks' text is: a special token's text becomes the special token."""
    text = tmp_path / "t.txt"
    text.write_text("Hello<|endoftext|>world")
    assert list(datafiles.read_tokens(text, enc, special=True)) == [15496, 50256, 6894]
    assert 50256 not in list(datafiles.read_tokens(text, enc))


def test_cli_student_next_to_teacher(ckpt, student, tmp_path, capsys):
    """--ckpt: a distill.py checkpoint's student is scored next to its teacher, the same way."""
    out = tmp_path / "r.json"
    evaluate_cli("--model", ckpt, "--ckpt", student, "--tasks", "arc_easy,winogrande", "--data-dir", EVAL,
                 "--limit", 2, "--output", out)
    printed = capsys.readouterr().out
    assert "teacher acc" in printed and "student acc" in printed
    r = json.loads(out.read_text())
    assert list(r["student"]["results"]) == ["arc_easy", "winogrande"]
    s = r["student"]["samples"]["arc_easy"][1]
    assert s["loglikelihoods"] != r["samples"]["arc_easy"][1]["loglikelihoods"]
    reloaded, enc = tasks.load_student(student)[0], load_tokenizer(ckpt)
    naive = [naive_loglikelihood(lambda x: reloaded(x), *evaluate.encode_pair(enc, c, t))[0] for c, t in s["requests"]]
    assert s["loglikelihoods"] == pytest.approx(naive, abs=1e-3)


def test_a_checkpoint_with_a_dim_short_is_refused(ckpt, student, tmp_path):
    """Dims for fewer layers than the teacher has: a sentence that says what to pass, not linearize's words."""
    shutil.copytree(student, bad := tmp_path / "short")
    edit_json(bad / "config.json", dims=[8])
    with pytest.raises(door.ModelError, match=r"^the dims \(1, the first 8\) are not a number per layer of this 2-layer "
                                         r"teacher; pass a checkpoint"):
        tasks.load_student(bad)


def without_timings(results_json):
    for part in (results_json, results_json.get("student", {})):
        for result in part.get("results", {}).values():
            result.pop("seconds")
    results_json.pop("world_size"), results_json["config"].pop("output")
    return results_json


def test_torchrun_two_processes_write_the_one_process_results_json(ckpt, student, tmp_path):
    """torchrun --nproc_per_node 2: each process scores a share of every task (teacher and student) and of the
    --ppl windows; rank 0 writes results.json equal to one process's, bit for bit, apart from timings and world_size."""
    args = ["--model", ckpt, "--ckpt", student, "--tasks", "all", "--data-dir", EVAL, "--limit", "5", "--batch-size",
            "3", "--ppl", WIKITEXT, "--ppl-max-tokens", "700", "--ppl-context", "64", "--device", "cpu"]
    evaluate.main([*map(str, args), "--output", str(tmp_path / "one.json")])
    assert not torch.distributed.is_initialized()  # one process: no process group
    r = torchrun("evaluate.py", *args, "--output", tmp_path / "two.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote") == 1 and r.stdout.count("ppl teacher") == 1  # rank 0 alone reports
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert without_timings(two) == without_timings(one)


def test_shares_of_every_scorer_merge_to_the_one_process_scores(tiny_gpt, enc, monkeypatch):
    """Three simulated ranks: each scores only its share (None elsewhere), the shares cover every request once,
    and put together they are the one-process scores exactly, for the fast scorer and for --plain."""
    docs = tokenized(enc, load_task("piqa", EVAL, 4) + load_task("mmlu", EVAL, 4) +
                     load_task("winogrande", EVAL, 3))
    for plain in (False, True):
        one, shares = evaluate.score_requests(tiny_gpt, docs, batch_size=2, plain=plain), []
        monkeypatch.setattr(devices, "all_gather", lambda share: shares.append(share) or [share, one])  # each share
        for rank in range(3):
            monkeypatch.setattr(devices, "get_rank", lambda: rank)
            monkeypatch.setattr(devices, "get_world_size", lambda: 3)
            evaluate.score_requests(tiny_gpt, docs, batch_size=2, plain=plain)
        monkeypatch.undo()
        for d, doc in enumerate(docs):
            for k in range(len(doc)):
                [score] = [share[d][k] for share in shares if share[d][k] is not None]  # exactly one rank scored it
                assert score == one[d][k], (plain, d, k)
        assert all(any(s is None for doc in share for s in doc) for share in shares)


@pytest.mark.parametrize("context", [None, 50, 2])                    # 2: the last window is one token
def test_perplexity_equals_transformers(tiny_gpt, enc, hf_model, context):
    tokens = datafiles.read_tokens(str(WIKITEXT), enc, 300, special=True)
    r = evaluate.perplexity(tiny_gpt, tokens, context)
    L, nll = context or N_POS, 0.0
    with torch.no_grad():
        for s in range(0, 299, L):  # windows of L inputs predicting the next L tokens; the last is shorter
            x = torch.tensor(tokens[s:min(s + L, 299)][None].astype("int64"))
            y = torch.tensor(tokens[s + 1:min(s + L, 299) + 1].astype("int64"))
            nll += float(F.cross_entropy(hf_model(x).logits[0], y, reduction="sum"))
    assert r["tokens"] == 299 and r["context"] == L and r["loss"] == pytest.approx(nll / 299, abs=1e-4)
    assert evaluate.perplexity(tiny_gpt, tokens[:60], context)["context"] == min(L, 59)  # a file shorter than a window
    assert r["ppl"] == pytest.approx(math.exp(r["loss"]))


def test_perplexity_of_a_loss_past_float_range_is_inf(tiny_gpt, monkeypatch):
    """A mean loss above 709.8 nats (a diverged student's) has a perplexity beyond float: inf, not an OverflowError
    after the whole pass."""
    monkeypatch.setattr(tiny_gpt, "nll", lambda x, y: torch.full((x.size(0),), 800.0 * x.size(1)))
    with pytest.warns(RuntimeWarning, match="overflow"):
        r = evaluate.perplexity(tiny_gpt, np.arange(300, dtype=np.uint16), 50)
    assert r["loss"] == pytest.approx(800.0) and r["ppl"] == math.inf


def run_cli(*args):
    p = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--device", "cpu", *map(str, args)], text=True,
                       capture_output=True, cwd=ROOT, timeout=120, env=script_env())
    return p.returncode, p.stderr.strip()


def test_bad_inputs_command_line(ckpt, tmp_path):
    """Through the real command line: exactly one line on stderr (no traceback), exit code 2."""
    rc, err = run_cli("--model", ckpt, "--tasks", "piqa,hellaswag", "--data-dir", EVAL)
    assert rc == 2 and err.startswith("error: unknown task 'hellaswag'") and "arc_challenge" in err and "\n" not in err

    bad = tmp_path / "data"
    bad.mkdir()
    lines = (EVAL / "arc_easy.jsonl").read_text().splitlines()
    doc = json.loads(lines[2])
    del doc["answerKey"]
    (bad / "arc_easy.jsonl").write_text("\n".join(lines[:2] + [json.dumps(doc)] + lines[3:]) + "\n")
    rc, err = run_cli("--model", ckpt, "--tasks", "arc_easy", "--data-dir", bad)
    assert rc == 2 and err.startswith(f"error: {bad / 'arc_easy.jsonl'} line 3:") and "'answerKey'" in err
    assert "\n" not in err

    other = tmp_path / "student"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"teacher": "EleutherAI/pythia-160m"}))
    rc, err = run_cli("--model", ckpt, "--ckpt", other, "--tasks", "piqa", "--data-dir", EVAL)
    assert rc == 2 and "distilled from teacher 'EleutherAI/pythia-160m'" in err and str(ckpt) in err


def test_a_moved_teacher_serves_its_student_and_another_model_at_its_path_is_refused(ckpt, student, tmp_path, capsys,
                                                                                     monkeypatch):
    """config.json names a local teacher by its path and fingerprint: after the teacher's folder moves, --model at
    the new place evaluates the student exactly as before (it had asked for the old path); another model put at the
    old path (one value changed) is refused in one sentence naming both, before any model is loaded, nothing
    written (it had passed the path check and failed later, or scored the wrong teacher)."""
    from test_loading import nudge
    old, moved, s = tmp_path / "teacher", tmp_path / "moved", tmp_path / "student"
    shutil.copytree(ckpt, old)
    shutil.copytree(student, s)
    edit_json(s / "config.json", teacher=str(old), teacher_fingerprint=checkpoint.fingerprint(old))
    old.rename(moved)
    flags = ["--ppl", WIKITEXT, "--ppl-max-tokens", 200, "--ppl-context", 64]
    evaluate_cli("--model", moved, "--ckpt", s, *flags, "--output", tmp_path / "moved.json")
    evaluate_cli("--model", ckpt, "--ckpt", student, *flags, "--output", tmp_path / "here.json")
    results = [json.loads((tmp_path / f).read_text())["ppl"] for f in ("moved.json", "here.json")]
    assert results[0] == results[1] and results[0]["student"]["loss"] != results[0]["teacher"]["loss"]
    nudge(shutil.copytree(ckpt, old) / "model.safetensors")
    monkeypatch.setattr(model.GPT, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    before, _ = snapshot(tmp_path), capsys.readouterr()
    code, err = evaluate_exit(capsys, "--model", old, "--ckpt", s, *flags, "--output", tmp_path / "other.json")
    assert code == 2 and err == (f"error: the teacher at {old} has changed since checkpoint {s} was distilled from it "
                                 "(its config or weights differ); put back the model it was, or distil a student of "
                                 "this one\n")
    assert snapshot(tmp_path) == before


def evaluate_exit(capsys, *args):
    """evaluate.py's command line in-process, ended as `python evaluate.py` ends it (common.run_main): the exit code
    and what it wrote on stderr."""
    import door
    with pytest.raises(SystemExit) as e:
        door.run_main(lambda: evaluate_cli(*args))
    return e.value.code, capsys.readouterr().err


BAD_OPTIONS = [  # flags (after --model --data-dir --tasks piqa --output), and the sentence on stderr
    (["--batch-size", 0], r"--batch-size must be a number of at least 1, got 0"),
    (["--limit", 0], r"--limit must be a number of at least 1, got 0"),
    (["--ppl", "val.bin", "--ppl-context", 0], r"--ppl-context must be a number of at least 1, got 0"),
    (["--ppl", "val.bin", "--ppl-context", -5], r"--ppl-context must be a number of at least 1, got -5"),
    (["--ppl", "val.bin", "--ppl-max-tokens", 0], r"--ppl-max-tokens must be a number of at least 2, got 0"),
    (["--speed", "--speed-tokens", 0], r"--speed-tokens must be a number of at least 2, got 0"),
    (["--device", "tpu"], r"--device tpu is not a device of this machine; use one of auto, cpu"),
    (["--device", "cuda:99"], r"--device cuda:99 is not a device of this machine; use one of auto, cpu"),
    (["--tasks", "piqa,hellaswag"], r"unknown task 'hellaswag'; known tasks: piqa, arc_easy, .*, wsc273 \(or 'all'\)"),
    (["--tasks", " , "], r"--tasks is empty; known tasks: piqa, "),
    (["--ppl", "folder"], r"--ppl \S+folder is a directory; pass a uint16 token file \(data/\*/prepare.py\) or a text"),
    (["--ppl", "missing.bin"], r"--ppl \S+missing.bin does not exist; pass a uint16 token file"),
    (["--ppl", "empty.bin"], r"--ppl \S+empty.bin is empty; pass a uint16 token file"),
    (["--ppl", "empty.txt"], r"--ppl \S+empty.txt is empty; pass a uint16 token file"),
    (["--output", "no/such/r.json"], r"--output \S+no/such/r.json is in \S+no/such, which does not exist; pass a "
                                     r"file path"),
    (["--output", "folder"], r"cannot write \S+folder: it is a directory; pass another --output"),
    (["--output", "new/"], r"cannot write \S*new/: it ends in /, as a directory does; pass another --output"),
    (["--output", "kept.json"], r"cannot write \S+kept.json: its temporary file kept.json.tmp would replace a "
                                r"folder; move that folder or pass another --output"),   # had been deleted, content too
    (["--ckpt", ""], r"--ckpt is empty; pass a value, or drop the flag"),
    (["--output", ""], r"--output is empty; pass a value, or drop the flag"),                 # had written nothing
    (["--ppl", ""], r"--ppl is empty; pass a value, or drop the flag"),
    (["--data-dir", ""], r"--data-dir is empty; pass a value, or drop the flag"),
]


@pytest.mark.parametrize("flags, sentence", BAD_OPTIONS, ids=[" ".join(map(str, f)) for f, _ in BAD_OPTIONS])
def test_bad_option_is_one_sentence_before_any_work(flags, sentence, ckpt, tmp_path, capsys, monkeypatch):
    """Every option is checked where it is declared, before a task is read or a model loaded: exit code 2, one
    sentence, and nothing written (the folders as they were, no results.json, no .tmp)."""
    import re
    (tmp_path / "folder").mkdir()
    (tmp_path / "kept.json.tmp").mkdir()
    (tmp_path / "kept.json.tmp" / "mine.txt").write_text("mine")
    (tmp_path / "empty.bin").touch()
    (tmp_path / "empty.txt").touch()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setattr(tasks, "load_task", lambda *a: pytest.fail("a task was read"))
    monkeypatch.setattr(tasks, "load_models", lambda *a: pytest.fail("a model was loaded"))
    flags = [tmp_path / f if str(f).endswith((".bin", ".txt", ".json", "folder")) else f for f in flags]
    code, err = evaluate_exit(capsys, "--model", ckpt, "--data-dir", EVAL, "--tasks", "piqa",
                              "--output", tmp_path / "r.json", *flags)
    assert code == 2 and re.fullmatch("error: " + sentence + r"[^\n]*\n", err), err
    assert sorted(tmp_path.rglob("*")) == before


def test_output_that_would_replace_a_file_the_run_reads_is_refused(ckpt, tmp_path, capsys):
    """--output on a task file, a checkpoint's file, a teacher file, a training file or the meta.json beside --ppl had
    replaced it with the results (a checkpoint's metrics.json too: its --resume then failed)."""
    shutil.copytree(EVAL, data := tmp_path / "eval")
    (student := tmp_path / "student").mkdir()
    (student / "config.json").write_text("[1, 2]")
    for name in ("metrics.json", "optim.pt"):
        (student / name).write_text("{}")
    (train := tmp_path / "train").mkdir()
    (train / "piqa_train.jsonl").write_text("{}")
    (tokens := tmp_path / "tokens").mkdir()
    np.arange(10, dtype=np.uint16).tofile(tokens / "val.bin")
    (tokens / "meta.json").write_text("{}")
    finetune = ["--finetune-epochs", 1, "--train-dir", train]
    cases = [(data / "piqa.jsonl", []), (student / "config.json", []), (student / "metrics.json", []),
             (student / "optim.pt", []), (Path(ckpt) / "config.json", []), (train / "piqa_train.jsonl", finetune),
             (tokens / "meta.json", ["--ppl", tokens / "val.bin"])]
    before = snapshot(tmp_path)
    for out, flags in cases:
        code, err = evaluate_exit(capsys, "--model", ckpt, "--ckpt", student, "--data-dir", data, "--tasks", "piqa",
                                  "--output", out, *flags)
        assert code == 2 and re.fullmatch(rf"error: --output {out} would replace a file this run reads [^\n]+\n", err)
    code, err = evaluate_exit(capsys, "--model", ckpt, "--ckpt", student, "--data-dir", data, "--tasks", "piqa")
    assert code == 2 and "config.json holds a JSON list, not an object" in err                  # had been a traceback
    assert snapshot(tmp_path) == before


def test_output_in_a_read_only_folder_fails_before_any_work(ckpt, tmp_path, capsys, monkeypatch):
    """--output where no file can be made: one sentence at the start, not a lost run at the end. A folder without
    write permission, or, where permissions do not bind (root), /sys, which refuses new files to everyone."""
    import re
    import tempfile
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for folder in (ro, Path("/sys")):
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError:
            break
    else:
        pytest.skip("every folder tried accepts a new file")
    monkeypatch.setattr(tasks, "load_models", lambda *a: pytest.fail("a model was loaded"))
    code, err = evaluate_exit(capsys, "--model", ckpt, "--data-dir", EVAL, "--tasks", "piqa",
                              "--output", folder / "results.json")
    assert code == 2 and re.fullmatch(rf"error: cannot write --output {folder}/results.json: {folder} is not "
                                      r"writable \([^)]+\); pass another --output\n", err), err
    assert not (folder / "results.json").exists() and list(ro.iterdir()) == []


def damaged(student, tmp_path, name, cut):
    """A copy of the student checkpoint with its file `name` cut to its first `cut` fraction."""
    d = tmp_path / "damaged"
    shutil.copytree(student, d)
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[:int(len(data) * cut)])
    return d


def test_bad_files_are_one_sentence_and_leave_nothing(ckpt, student, tmp_path, capsys):
    """Files found bad only when read (a damaged checkpoint, a task file that is not there, token files that do not
    fit the model): exit code 2, one sentence naming the file, and no results.json or .tmp written."""
    import re
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.array([1, 2, 65535], dtype=np.uint16).tofile(tmp_path / "big.bin")
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    np.arange(1, dtype=np.uint16).tofile(tmp_path / "one.bin")
    cases = [
        (["--ppl", tmp_path / "one.bin"], r"the --ppl file holds fewer than 2 tokens; give it more text"),
        (["--ckpt", damaged(student, tmp_path / "a", "config.json", 0.5)],
         r"\S+/config.json is damaged or truncated \(.+\); pass a complete distill.py checkpoint as --ckpt"),
        (["--ckpt", damaged(student, tmp_path / "b", "features.safetensors", 0.5)],
         r"\S+/features.safetensors is damaged or truncated \(.+\); .+"),
        (["--ckpt", tmp_path / "nowhere"],
         r"\S+/nowhere/config.json does not exist; pass a complete distill.py checkpoint as --ckpt"),
        (["--data-dir", tmp_path], rf"{tmp_path}/piqa.jsonl does not exist: --data-dir must hold a piqa.jsonl .+"),
        (["--ppl", tmp_path / "odd.bin"], r"\S+odd.bin has an odd number of bytes, so it is not a uint16 token file; prepare it again"),
        (["--ppl", tmp_path / "big.bin"], r"the --ppl file holds token id 65535, beyond the model's vocabulary of "
                                          r"50257: was it prepared with another tokenizer\?"),
        (["--ppl", tmp_path / "val.bin", "--ppl-context", 1000], r"--ppl-context 1000 is more than the model's "
                                                                 r"context of 128 tokens; pass at most --ppl-context 128"),
        (["--speed", "--speed-tokens", 129], r"--speed-tokens 129 is more than the model's context of 128 tokens; "
                                             r"pass at most --speed-tokens 128"),        # had been cut to 128
    ]
    for flags, sentence in cases:
        out = tmp_path / "r.json"
        code, err = evaluate_exit(capsys, "--model", ckpt, "--data-dir", EVAL, "--tasks", "piqa", "--limit", 1,
                                  "--output", out, *flags)
        assert code == 2 and re.fullmatch("error: " + sentence + r"\n", err), err
        assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_tasks_from_an_unreachable_hub_come_from_the_cache_at_once(monkeypatch):
    """Without --data-dir and without the hub, datasets is put offline before it is asked (its cache, or one sentence
    at once; it had retried for half a minute, printing each retry, before the sentence), after one probe of the hub."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    probes, asked = [], []
    monkeypatch.setattr(checkpoint, "hub_reachable", lambda: probes.append(1) and False)

    def load_dataset(path, name, split):
        asked.append(datasets.config.HF_HUB_OFFLINE)
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(door.ModelError, match=r"^could not load piqa from the hub \(ConnectionError in datasets.load_"
                                         r"dataset\('baber/piqa', None, 'validation'\)\); pass --data-dir DIR holding"):
        load_task("piqa")
    with pytest.raises(door.ModelError, match=r"^could not load arc_easy from the hub"):
        load_task("arc_easy")
    with pytest.raises(door.ModelError, match=r"'train'\)\); pass --train-dir DIR holding arc_easy_train.jsonl$"):
        tasks.hub_documents("arc_easy", "train")                     # a training split: --train-dir is the way
    assert asked == [True, True, True] and probes == [1]              # one connection test, not one per task


def test_bad_documents_name_their_file_and_line(tmp_path):
    bad = tmp_path / "data"
    bad.mkdir()
    lines = (EVAL / "piqa.jsonl").read_text().splitlines()
    doc = json.loads(lines[1])
    doc["label"] = 2
    (bad / "piqa.jsonl").write_text("\n".join([lines[0], json.dumps(doc)]) + "\n")
    with pytest.raises(door.ModelError, match=r"piqa.jsonl line 2: malformed piqa document \(label 2 is not one of its "
                                         r"choices \[0, 1\]\)"):
        load_task("piqa", bad)
    doc["label"] = True                                              # JSON true is not the label 1
    (bad / "piqa.jsonl").write_text(json.dumps(doc) + "\n")
    with pytest.raises(door.ModelError, match=r"piqa.jsonl line 1: malformed piqa document \(label True is not one"):
        load_task("piqa", bad)
    doc = json.loads((EVAL / "winogrande.jsonl").read_text().splitlines()[0])
    doc["answer"] = "3"
    (bad / "winogrande.jsonl").write_text(json.dumps(doc) + "\n")
    with pytest.raises(door.ModelError, match="winogrande.jsonl line 1: malformed winogrande document .answer '3' is not"):
        load_task("winogrande", bad)
    doc = json.loads((EVAL / "mmlu.jsonl").read_text().splitlines()[0])
    del doc["subject"]
    (bad / "mmlu.jsonl").write_text("\n" + json.dumps(doc) + "\n")
    with pytest.raises(door.ModelError, match="mmlu.jsonl line 2: document has no field 'subject'; see tests/data/eval"):
        load_task("mmlu", bad)
    (bad / "logiqa.jsonl").write_text("{not json\n")
    with pytest.raises(door.ModelError, match=r"logiqa.jsonl line 1 is not valid JSON \(Expecting property name"):
        load_task("logiqa", bad)
    (bad / "arc_easy.jsonl").write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(door.ModelError, match=r"arc_easy.jsonl line 1 is not valid JSON"):
        load_task("arc_easy", bad)
    (bad / "piqa.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(door.ModelError, match=r"piqa.jsonl line 1 is not valid JSON \(maximum recursion depth"):
        load_task("piqa", bad)                                      # nested past Python's stack
    (bad / "arc_challenge.jsonl").write_text("[1, 2]\n")
    with pytest.raises(door.ModelError, match=r"arc_challenge.jsonl line 1: malformed arc_challenge document"):
        load_task("arc_challenge", bad)
    (bad / "wsc273.jsonl").write_text("\n\n")
    with pytest.raises(door.ModelError, match=r"wsc273.jsonl holds no documents"):
        load_task("wsc273", bad)


@pytest.mark.parametrize("name, edit, why", [
    ("arc_easy", lambda d: d["choices"]["label"].append("E"), r"choices has 4 texts but 5 labels"),
    ("mmlu", lambda d: d["choices"].pop(), r"choices has 3 entries, MMLU's prompt needs 4"),
    ("winogrande", lambda d: d.update(sentence=d["sentence"].replace("_", "it")), r"sentence has no '_' blank"),
    ("wsc273", lambda d: d["options"].append("the police"), r"options has 3 entries, WSC273 needs 2"),
])
def test_a_document_its_prompt_would_misread_is_refused_by_what_it_lacks(tmp_path, name, edit, why):
    """Shapes a prompt function takes for granted: without the check, an arc document with a label no text has, or a
    wsc273 document with a third option, is scored silently; the others fail with Python's bare words."""
    doc = json.loads((EVAL / f"{name}.jsonl").read_text().splitlines()[0])
    edit(doc)
    (tmp_path / f"{name}.jsonl").write_text(json.dumps(doc) + "\n")
    where = re.escape(str(tmp_path / f"{name}.jsonl"))
    with pytest.raises(door.ModelError, match=rf"^{where} line 1: malformed {name} document \({why}\)$"):
        load_task(name, tmp_path)


def test_bad_input_in_library_raises_model_error():
    with pytest.raises(door.ModelError, match="unknown task"):
        tasks.parse_tasks("piqa,nope")
    with pytest.raises(door.ModelError, match="does not exist"):
        load_task("piqa", "/nonexistent-dir")
    with pytest.raises(door.ModelError, match="a continuation of 0 tokens cannot be scored"):
        tasks.check_requests([[([1, 2], [])]], N_POS)


def test_every_process_refuses_a_request_that_another_process_scores():
    """Under torchrun each process scores a share of the documents, but an unscorable request anywhere is refused by
    every process (each checks every request before scoring): one that alone raised would stop without its sentence
    (only rank 0 prints)."""
    docs = [[([1, 2], [3] * (N_POS + 1))], [([1, 2], [3])]]                  # document 0 is rank 0's
    with pytest.raises(door.ModelError, match=f"a continuation of {N_POS + 1} tokens cannot be scored"):
        tasks.check_requests(docs, N_POS)


# ==================================================================================================================
# evaluate.py's --ppl and speed: each pinned to a known answer

def test_cli_ppl_scores_each_model_with_the_context_and_special_tokens_given(ckpt, student, enc, tmp_path):
    """evaluate.py --ppl FILE --ppl-context 50 --ckpt: each model's own loss, on FILE encoded as the tasks' text (a
    special token's text is the special token), in windows of --ppl-context tokens: evaluate.perplexity's on those
    tokens, bit for bit."""
    text = tmp_path / "t.txt"
    text.write_text(WIKITEXT.read_text(encoding="utf-8")[:1500] + "<|endoftext|>" + "The end of it.")
    out = tmp_path / "r.json"
    evaluate_cli("--model", ckpt, "--ckpt", student, "--ppl", text, "--ppl-context", 50, "--batch-size", 3,
                 "--output", out)
    r = json.loads(out.read_text())["ppl"]
    tokens = datafiles.read_tokens(text, enc, special=True)
    assert 50256 in tokens.tolist()
    for name, m in (("teacher", GPT.from_pretrained(ckpt)), ("student", tasks.load_student(student)[0])):
        want = evaluate.perplexity(m, tokens, 50, batch_size=3)
        assert r[name]["tokens"] == len(tokens) - 1 and r[name]["context"] == 50, (name, r[name])
        assert r[name]["loss"] == want["loss"], name                         # the same windows, batches and sums
    assert r["student"]["loss"] != r["teacher"]["loss"]          # near-uniform tiny models: apart in the 6th digit


def test_perplexity_does_not_depend_on_the_batch_size(tiny_gpt, enc):
    """evaluate.perplexity with 1, 2 or 3 windows per forward pass scores every window of the file, as 64 a pass
    does (300 tokens: windows of 128, 50 and 7 tokens, the last shorter)."""
    tokens = datafiles.read_tokens(str(WIKITEXT), enc, 300, special=True)
    for context in (None, 50, 7):
        want = evaluate.perplexity(tiny_gpt, tokens, context, batch_size=64)
        for b in (1, 2, 3):
            got = evaluate.perplexity(tiny_gpt, tokens, context, batch_size=b)
            assert got["tokens"] == want["tokens"] == 299 and got["loss"] == pytest.approx(want["loss"], rel=1e-6), (
                context, b)


def test_task_files_with_crlf_line_ends_and_blank_lines_of_spaces_are_read(tmp_path):
    """A task file with CRLF line ends and blank lines, empty or of spaces, between its documents: the prompts of the
    first 3 lines of tests/data/eval/piqa.jsonl, as read from that file."""
    lines = (EVAL / "piqa.jsonl").read_text(encoding="utf-8").splitlines()[:3]
    (tmp_path / "piqa.jsonl").write_bytes(("\r\n".join([lines[0], "", lines[1], "   ", lines[2]]) + "\r\n").encode())
    assert load_task("piqa", tmp_path) == load_task("piqa", EVAL, 3)


def test_speed_times_the_second_prefill_and_decodes_to_the_context(tiny_gpt, monkeypatch):
    """A clock that the warm-up prefill moves 5 s, the timed prefill 2 s and generation 7 s: prefill_s 2, generate_s
    7; --speed-tokens at the context (door.validate refuses more), n tokens in all: the first, then n - 1 decoded (the last is
    not fed back), so the forward passes see n, n, then 1 token n - 1 times."""
    clock, hidden, generate, calls = [0.0], tiny_gpt.hidden, tiny_gpt.generate, []
    monkeypatch.setattr(devices, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def timed_hidden(*a, **k):
        calls.append(a[0].size(1))
        clock[0] += {1: 5.0, 2: 2.0}.get(len(calls), 0.0)                  # warm-up 5 s, timed prefill 2 s
        return hidden(*a, **k)

    def timed_generate(*a, **k):
        clock[0] += 7.0
        return generate(*a, **k)
    monkeypatch.setattr(tiny_gpt, "hidden", timed_hidden)
    monkeypatch.setattr(tiny_gpt, "generate", timed_generate)
    n = tiny_gpt.config.block_size
    r = evaluate.speed(tiny_gpt, n)
    assert r == {"tokens": n, "prefill_s": 2.0, "generate_s": 7.0}
    assert calls == [n, n] + [1] * (n - 1)
