"""docs/: figures.py's figures from a model, experiments.py's runner and the tables it makes from the committed
result files; and the README's numbers and commands, held to the code, the result files and .ci/run."""

import dataclasses
import importlib.util
import json
import math
import re
import shutil
import signal
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import distill
import dof
import door
import evaluate
from conftest import DATA, ROOT, WIKITEXT, load_script
from test_dof import hf_llama, save_hf  # the method's test helpers

# ==================================================================================================================
# README.md: what it says of the code, held to the code

README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"


def readme():
    """README.md with every run of whitespace one space: a sentence reads the same across lines."""
    return " ".join(README.read_text(encoding="utf-8").split())


def test_readme_describes_the_cpu_preset_as_distill_defines_it():
    """The README's words on --preset cpu (budget, steps, window, one window a step, relative λ,
    centred keys, the 10% held out, its 8 validation windows, its steps beside the results' 240)
    are distill.DistillConfig.PRESETS["cpu"]'s flags."""
    flags = distill.DistillConfig.PRESETS["cpu"].split()
    value = lambda name: flags[flags.index(name) + 1]
    text = readme()
    said = re.search(r"`--preset cpu` prints the flags it stands for \(budget (\d+), relative λ, "
                     r"key centring, (\d+) steps of one (\d+)-token window\)", text)
    assert said, "README.md no longer describes --preset cpu's flags"
    assert said.groups() == (value("--budget"), value("--max-steps"), value("--block-size"))
    assert value("--batch-size") == "1" and {"--lam-relative", "--center-keys"} <= set(flags)
    assert "(the last 10% held out as val.bin)" in text and float(value("--val-fraction")) == 0.1
    assert f"`--eval-iters` (the preset's {value('--eval-iters')})" in text
    assert re.findall(r"`--preset cpu`'s (\d+)\)", text) == [value("--max-steps")]


def test_readme_numbers_of_the_results_runs_are_the_result_files():
    """The teacher's loss the README quotes from distill.py's summary is the preset run's at seed 0
    (the quick start's seed), and the Results section's runs (budget 32, 240 steps of one 256-token
    window) are the allocation grid's."""
    run = json.loads((RESULTS / "preset" / "layerwise450-s0.json").read_text())
    assert "--preset cpu" in run["command"] and run["seed"] == 0
    assert run["args"]["data"]["source"] == "text"
    assert f"not the {run['val'][-1]['teacher_loss']:.3f} of distill.py's summary" in readme()
    said = re.search(r"the budget (\d+) features per head \(layerwise softmax loss, centred keys, "
                     r"(\d+) steps of one (\d+)-token window", readme())
    assert said, "README.md no longer describes the Results section's runs"
    runs = sorted((RESULTS / "allocation").glob("b32-*.json"))
    assert len(runs) >= 12
    for p in runs:
        args = json.loads(p.read_text())["args"]["args"]
        kept = (str(args["budget"]), str(args["max_steps"]), str(args["block_size"]))
        assert said.groups() == kept, p.name
        assert args["batch_size"] == 1 and args["loss"] == "softmax" and args["center_keys"], p.name


def test_every_flag_the_readme_gives_a_core_script_is_one_of_its_flags():
    """Each `python distill.py|evaluate.py|dof.py ...` command of the README (continued lines
    joined) passes only flags its configuration has."""
    configs = {"distill": distill.DistillConfig, "evaluate": evaluate.EvalConfig,
               "dof": dof.DofConfig}
    known = {name: {door.flag(f.name) for f in dataclasses.fields(config)}
             for name, config in configs.items()}
    command = r"(?:python|torchrun[^`\n]*?) (distill|evaluate|dof)\.py ((?:[^`\n\\]|\\\n)*)"
    commands = re.findall(command, README.read_text(encoding="utf-8"))
    assert {script for script, _ in commands} == set(configs) and len(commands) > 8
    for script, args in commands:
        unknown = set(re.findall(r"--[a-z][a-z0-9-]*", args)) - known[script]
        assert not unknown, (script, args, unknown)


def test_readme_test_steps_are_what_ci_runs():
    """The README's test commands, line for line, are .ci/run's (which adds -q to pip), in order."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"\*\*Tests\.\*\*.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md no longer has its Tests paragraph"
    said = [line.split() for line in block.group(1).splitlines()]
    ci = [line.split() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = [[w for w in line if w != "-q"] if line[:1] == ["pip"] else line for line in ci]
    assert said == [line for line in ci if line[:1] in (["pip"], ["ruff"], ["python"])]
    assert ["ruff", "check", "."] in said and said[-1] == ["python", "-m", "pytest", "-q"]


# ==================================================================================================================
# docs/results/: the committed result files

def test_result_files_name_no_path_of_the_machine_they_ran_on():
    """Every string in docs/results/**/*.json that looks like a path is relative to the repository."""
    def strings(x):
        if isinstance(x, dict):
            return [s for v in x.values() for s in strings(v)]
        return [s for v in x for s in strings(v)] if isinstance(x, list) else [x] if isinstance(x, str) else []
    for p in (ROOT / "docs" / "results").rglob("*.json"):
        absolute = [s for s in strings(json.loads(p.read_text())) if re.fullmatch(r"(/|~/|[A-Z]:\\)\S+", s)]
        assert not absolute, (p, absolute[:3])


# ==================================================================================================================
# docs/figures.py: the README's figures from a model, and one sentence without matplotlib

@pytest.fixture(scope="module")
def figures_run(tmp_path_factory):
    """docs/figures.py as a module; a tiny Llama with GPT-2's tokenizer, its --data folder (text.txt, and the
    train.bin and meta.json distill.py prepared), a student distilled from it in two steps, and fast flags."""
    spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    d = tmp_path_factory.mktemp("figures")
    torch.manual_seed(0)
    ckpt = d / "llama"
    save_hf(hf_llama(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                     intermediate_size=96, vocab_size=50257, max_position_embeddings=128), ckpt)
    shutil.copy(DATA / "gpt2-tokenizer" / "encoder.json", ckpt / "vocab.json")
    shutil.copy(DATA / "gpt2-tokenizer" / "vocab.bpe", ckpt / "merges.txt")
    (d / "data").mkdir()
    (d / "data" / "text.txt").write_text(WIKITEXT.read_text(encoding="utf-8")[:12000], encoding="utf-8")
    distill.main(["--model", str(ckpt), "--data", str(d / "data"), "--block-size", "32", "--batch-size", "1",
                  "--max-steps", "2", "--eval-interval", "2", "--eval-iters", "1", "--J", "16", "--calib-batches",
                  "1", "--budget", "4", "--center-keys", "--out-dir", str(d / "student")])
    args = ["--model", str(ckpt), "--text", str(d / "data" / "text.txt"), "--tokens", "400", "--block-size",
            "64", "--J", "64", "--budget", "4", "--draws", "1", "--window", "16"]
    return types.SimpleNamespace(figures=figures, ckpt=ckpt, data=d / "data", student=d / "student", args=args)


def test_figures_script_writes_valid_pngs_and_needs_matplotlib(figures_run, tmp_path, monkeypatch, capsys):
    import door
    figures, args = figures_run.figures, figures_run.args
    figures.main(args + ["--ckpt", str(figures_run.student), "--out", str(tmp_path / "figs")])
    names = ["fig-spectrum.png", "fig-kernel-error.png", "fig-attention.png", "fig-dof.png"]
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(names + ["figures.json"])
    numbers = json.loads((tmp_path / "figs" / "figures.json").read_text())   # what the figures show, as numbers
    N, x_rms, log_k = (np.array(numbers[k]) for k in ("N", "x_rms", "log_K_max"))
    assert N.shape == x_rms.shape == (2, 4) and numbers["text"] == args[args.index("--text") + 1]
    for h in numbers["heads"]:                                             # the two heads drawn, with their N
        assert h["N"] == N[h["layer"], h["head"]] and len(h["misplaced"]) == len(numbers["M"])
        assert h["x_tilde"] == numbers["x_tilde_rms"][h["layer"]][h["head"]]
    assert numbers["heads"][0]["N"] == N.max(1).min() and numbers["heads"][1]["N"] == N.max(1).max()
    assert (log_k >= x_rms ** 2 / 16 ** 0.5 - 1e-2).all()                  # the largest |x|^2 / sqrt d, d = 16
    assert all(0 < v <= 1 for row in numbers["N_over_J_at_2^-4"] for v in row)
    assert figures.repo_path(str(ROOT / "data" / "wikitext2")) == str(Path("data") / "wikitext2")
    import matplotlib.pyplot as plt
    for name in names:
        path = tmp_path / "figs" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plt.imread(path).ndim == 3
    assert "untrained student only" not in capsys.readouterr().out
    with pytest.raises(door.ModelError, match=r"data/config.json does not exist; \S+ is not a whole distill.py checkpoint"):
        figures.main(args + ["--ckpt", str(figures_run.data), "--out", str(tmp_path / "bad")])
    for flag in ("--J", "--draws", "--budget", "--window"):
        with pytest.raises(door.ModelError, match=f"^{flag} must be a number of at least 1, got 0$"):
            figures.main(args + [flag, "0", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()                              # refused before any figure
    (tmp_path / "file").write_text("")                                 # these had been tracebacks
    with pytest.raises(door.ModelError, match=r"^--out \S+file is a file; pass a directory$"):
        figures.main(args + ["--out", str(tmp_path / "file")])
    import matplotlib.figure

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(door.ModelError, match=r"^cannot write the figures into \S+full \(No space left on device\); make "):
        figures.main(args + ["--out", str(tmp_path / "full")])
    assert not any((tmp_path / "full").iterdir()) and not (tmp_path / "bad").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        door.run_main(lambda: figures.main(args + ["--out", str(tmp_path / "none")]))
    assert e.value.code == 2 and not (tmp_path / "none").exists()
    assert capsys.readouterr().err == "error: the figures need matplotlib, which is not installed; pip install matplotlib\n"


def test_figures_keep_the_readmes_figures_and_their_own_text(figures_run, tmp_path):
    """--out docs, the README's figures of SmolLM2-135M and its student, is refused for another model and without
    --ckpt; so is a --text that is a file the run writes; each before any work (each had been replaced)."""
    figures, args, docs = figures_run.figures, figures_run.args, ROOT / "docs"
    committed = {f: (docs / f).read_bytes() for f in figures.OUTPUTS}
    docs_refused = r"--out \S+ holds the README's figures of SmolLM2-135M and its student \(--ckpt\)"
    (tmp_path / "figs").mkdir()
    text = tmp_path / "figs" / "figures.json"
    text.write_text(figures_run.data.joinpath("text.txt").read_text())
    cases = [(["--ckpt", str(figures_run.student), "--out", str(docs)], docs_refused),
             (["--model", "smollm2-135m", "--out", str(docs)], docs_refused),
             (["--text", str(text), "--out", str(tmp_path / "figs")], r"--text \S+ is a file this run writes")]
    for flags, sentence in cases:
        with pytest.raises(door.ModelError, match=f"^{sentence}; pass another --out"):
            figures.main(args + flags)
    assert {f: (docs / f).read_bytes() for f in figures.OUTPUTS} == committed
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["figures.json"]


def test_figures_refuse_a_checkpoint_distilled_from_another_teacher(figures_run, tmp_path):
    """--ckpt of a student of another teacher of the same config (here a copy of it elsewhere): one sentence, as
    evaluate.py says it, before any figure; it had drawn the student of the other teacher."""
    twin = tmp_path / "twin"
    shutil.copytree(figures_run.ckpt, twin)
    args = [str(twin) if a == str(figures_run.ckpt) else a for a in figures_run.args]
    with pytest.raises(door.ModelError, match=r"^checkpoint \S+student was distilled from teacher '\S+llama' but --model "
                                         r"is '\S+twin'; pass --model \S+llama$"):
        figures_run.figures.main(args + ["--ckpt", str(figures_run.student), "--out", str(tmp_path / "figs")])
    assert not (tmp_path / "figs").exists()


def test_figures_text_of_token_files_is_checked_against_the_models_tokenizer(figures_run, tmp_path):
    """--text a prepared .bin: its meta.json's tokenizer is checked (one sentence for another's, as evaluate.py's
    --ppl), and the memory-mapped tokens give no warning of a non-writable array."""
    import warnings
    figures, data = figures_run.figures, figures_run.data
    args = [str(data / "train.bin") if a.endswith("text.txt") else a for a in figures_run.args]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        figures.main(args + ["--out", str(tmp_path / "figs")])
    assert not [str(w.message) for w in caught if "not writable" in str(w.message)]
    (tmp_path / "other").mkdir()
    shutil.copy(data / "train.bin", tmp_path / "other" / "train.bin")
    meta = json.loads((data / "meta.json").read_text())
    meta["tokenizer"]["n_vocab"] = 49152                              # SmolLM2's, say
    (tmp_path / "other" / "meta.json").write_text(json.dumps(meta))
    other = [str(tmp_path / "other" / "train.bin") if a.endswith("text.txt") else a for a in figures_run.args]
    with pytest.raises(door.ModelError, match=r"^\S+train.bin was tokenized with the tokenizer of \S+ \(49152 tokens\), not "
                                         r"\S+llama's \(50257\); pass a file made with this model's tokenizer"):
        figures.main(other + ["--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_figures_refuse_a_lambda_above_every_eigenvalue_and_replace_all_figures_or_none(figures_run, tmp_path,
                                                                                          monkeypatch):
    """--lam 1e300 leaves every head N = 0: one sentence before any figure (it had been matplotlib's ValueError
    after three of the four figures were replaced); a figure that fails to draw leaves the earlier ones as they were."""
    figures, out = figures_run.figures, tmp_path / "figs"
    figures.main(figures_run.args + ["--out", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == sorted(figures.OUTPUTS)
    for flags in (["--lam", "1e300"], ["--lam", "1e300", "--lam-absolute"]):
        with pytest.raises(door.ModelError, match=r"^--lam 1e\+300 leaves every head N = 0"):
            figures.main(figures_run.args + flags + ["--out", str(out)])
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    def broken(*args):
        raise RuntimeError("drawing failed")
    monkeypatch.setattr(figures, "fig_dof", broken)                 # the last figure fails, the others are new
    with pytest.raises(RuntimeError, match="drawing failed"):
        figures.main(figures_run.args + ["--J", "32", "--out", str(out)])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_figures_refuse_a_budget_beyond_memory_before_any_figure(figures_run, tmp_path):
    """--budget 2^40 without --ckpt: the untrained student of the attention maps would need 2^40 features per head;
    one sentence before any work (it had been an allocation error after two figures were drawn)."""
    out = tmp_path / "figs"
    with pytest.raises(door.ModelError, match=r"^an untrained student of --budget 1099511627776 features needs about "
                                         r"[\d,.]+ GiB, more than the [\d.]+ GiB free on cpu; pass a smaller --budget$"):
        figures_run.figures.main(figures_run.args + ["--budget", str(2 ** 40), "--out", str(out)])
    assert not out.exists()


# ----------------------------------------------------------------------------------------------------------------
# docs/experiments.py: one JSON per run, tables generated from them

def docs_experiments():
    """docs/experiments.py as a module (its name clashes with the experiments/ folder's)."""
    spec = importlib.util.spec_from_file_location("docs_experiments", ROOT / "docs" / "experiments.py")
    X = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(X)
    return X


def test_published_tables_are_the_ones_the_committed_result_files_make(tmp_path):
    """Every generated block of docs/results.md and the README is what `python docs/experiments.py --report`
    rebuilds from docs/results/: a table edited by hand, or a result file changed without its table, fails here; and
    every block it makes has its markers in one of them (a result file with none was published nowhere)."""
    docs = [ROOT / "docs" / "results.md", ROOT / "README.md"]
    for doc in docs:
        shutil.copy(doc, tmp_path / doc.name)
    made = docs_experiments().rebuild_docs(docs=[tmp_path / doc.name for doc in docs], figures=tmp_path)
    for doc in docs:
        assert (tmp_path / doc.name).read_text() == doc.read_text(), f"{doc.name}: python docs/experiments.py --report"
    text = "".join(doc.read_text() for doc in docs)
    assert len(made) > 30 and not [n for n in made if f"<!-- begin {n} -->" not in text], made.keys()


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_text(p.read_text()[:100]), r"b32-dof-s0.json is damaged or truncated \(JSONDecodeError"),
    (lambda p: p.write_text("[]"), r"b32-dof-s0.json holds a JSON list, not an object"),          # had been dropped
    (lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"val": []})), r"claim holds a result file its "
     r"script did not write \(IndexError"),
    (lambda p: p.write_text(json.dumps((r := json.loads(p.read_text())) | {"val": r["val"][:-1] + [
        r["val"][-1] | {"student_loss": float("nan")}]})), r"run b32-dof-s0 ended at a loss that is not finite"),
    (lambda p: p.write_text(json.dumps((r := json.loads(p.read_text())) | {"val": r["val"][:-1] + [
        r["val"][-1] | {"attn_kl": [math.nan] + r["val"][-1]["attn_kl"][1:]}]})), r"run b32-dof-s0 ended at a loss"),
    (lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"group": "abc"})), r"claim holds a result "
     r"file its script did not write \(ValueError: invalid literal"),
    (lambda p: (p.parents[1] / "zeroshot").mkdir() or (p.parents[1] / "zeroshot" / "r.json").write_text('{"x": 1}'),
     r"zeroshot holds a result file its script did not write \(KeyError: 'results'\)"),
    (lambda p: p.unlink(), r"claim lacks the whole runs b32-dof-s0; run them with `python docs/experiments.py --run "
     r"claim` \(it resumes unfinished runs\), then --report"),                # had left DoF's mean to two seeds
    (lambda p: p.write_text(json.dumps((r := json.loads(p.read_text())) | {"args": r["args"] | {"args": r["args"][
        "args"] | {"max_steps": 480}}})), r"claim lacks the whole runs b32-dof-s0; run them")])    # stopped at 240
def test_report_refuses_a_damaged_result_file_in_one_sentence(tmp_path, damage, match):
    """--report on a result file cut, of another type, edited, missing or of a run that stopped early: one sentence
    naming it, and no doc rewritten."""
    shutil.copytree(ROOT / "docs" / "results" / "claim", tmp_path / "results" / "claim")
    doc = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", doc)
    docs_experiments().rebuild_docs(docs=[doc], results=tmp_path / "results", figures=tmp_path)   # the grid alone
    damage(tmp_path / "results" / "claim" / "b32-dof-s0.json")
    with pytest.raises(door.ModelError, match=match):
        docs_experiments().rebuild_docs(docs=[doc], results=tmp_path / "results", figures=tmp_path)
    assert doc.read_text() == (ROOT / "docs" / "results.md").read_text()


def test_report_without_matplotlib_notes_each_figure_it_does_not_draw(tmp_path, monkeypatch, capsys):
    """--report without matplotlib: the tables are rebuilt, and the layer curves (curves grid) and
    bench/heads.py's figure are each a note, as the learning curves are; they had been a ModuleNotFoundError."""
    for grid in ("curves", "heads-kl"):
        shutil.copytree(ROOT / "docs" / "results" / grid, tmp_path / "results" / grid)
    doc = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", doc)
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # import matplotlib -> ImportError
    docs_experiments().rebuild_docs(docs=[doc], results=tmp_path / "results", figures=tmp_path)
    out = capsys.readouterr().out
    assert "fig-layer-curves.png was not drawn; pip install matplotlib" in out
    assert "fig-heads.png was not drawn; pip install matplotlib" in out
    assert doc.read_text() == (ROOT / "docs" / "results.md").read_text() and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("grids", [("allocation", "curves"), ("curves",)])
def test_report_names_the_curve_runs_that_are_missing(tmp_path, grids):
    """A curve run missing: one sentence naming it and the grid to run, where the curves' tables and the allocation
    grid's (which read the curves) are made; it had been "allocation holds a result file its script did not write
    (ValueError: 32 is not in list)". A damaged curve run is the curves folder's, reported before the allocation."""
    for grid in grids:
        shutil.copytree(ROOT / "docs" / "results" / grid, tmp_path / "results" / grid)
    (tmp_path / "results" / "curves" / "fix-m32-s0.json").unlink()
    doc = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", doc)
    with pytest.raises(door.ModelError, match=r"^\S+/results/curves lacks the whole runs fix-m32-s0; run them with "
                                         r"`python docs/experiments.py --run curves`"):
        docs_experiments().rebuild_docs(docs=[doc], results=tmp_path / "results", figures=tmp_path)
    assert doc.read_text() == (ROOT / "docs" / "results.md").read_text()
    if len(grids) == 2:                        # a damaged curve run is the curves folder's, not the allocation one's
        (tmp_path / "results" / "curves" / "fix-m16-s0.json").write_text('{"group": "16/Fix", "val": []}')
        with pytest.raises(door.ModelError, match=r"^\S+/results/curves holds a result file its script did not write"):
            docs_experiments().rebuild_docs(docs=[doc], results=tmp_path / "results", figures=tmp_path)


def test_allocation_table_pairs_seeds_and_gives_shares_only_of_a_clear_gain():
    """Each rule minus Fix seed by seed, with its share of the measured rule's gain in KL; no share when that gain is
    within two standard errors of zero; the Δ KL the curves predict for the runs' own dims."""
    X = docs_experiments()
    rec = lambda rule, s, loss, kl: {"group": f"32/{rule}", "seed": s, "allocation": rule.lower(),
                                     "val": [{"student_loss": loss, "attn_kl": [kl, kl], "teacher_loss": 3.0}]}
    fix = [rec("Fix", s, 5.0 + s, 0.80 + s / 100) for s in (1, 2, 3)]
    by_dof = [rec("DoF", s, 5.1 + s, 0.80 + s / 100 - d) for s, d in ((1, 0.01), (2, 0.02), (3, 0.03))]
    clear = X.allocation_table(fix + by_dof + [rec("Measured", s, 5.0 + s, 0.76 + s / 100 + e)
                                               for s, e in ((1, 0.0), (2, 0.001), (3, -0.001))])
    assert "| DoF (`dof`) | 3 | +0.100 ± 0.000 | -0.0200 ± 0.0058 | +50% |" in clear
    assert "| Measured (`measured`) | 3 | +0.000 ± 0.000 | -0.0400 ± 0.0006 | +100% |" in clear
    noisy = X.allocation_table(fix + by_dof + [rec("Measured", s, 5.0 + s, 0.80 + s / 100 + e)
                                               for s, e in ((1, 0.01), (2, -0.02), (3, 0.005))])
    assert "| -0.0200 ± 0.0058 | – |" in noisy and "is within two standard errors of zero" in noisy
    import allocation  # the curves' prediction for each run's dims
    curves = ROOT / "docs" / "results" / "curves"
    Ms, KL = allocation.load_curves(curves)
    dims = {"Fix": [32] * KL.shape[1], "Measured": allocation.measured_dims(Ms, KL, 32)}
    table = X.allocation_table([{**rec(r, s, 5.0, 0.8), "dims": dims[r]} for r in dims for s in (1, 2)],
                               curves_dir=curves)
    want = allocation.expected_kl(Ms, KL, dims["Measured"]) - allocation.expected_kl(Ms, KL, dims["Fix"])
    assert want < 0 and table.splitlines()[2].endswith(f"| {want:+.4f} |"), table


def test_runner_writes_one_json_per_run_and_rebuilds_tables_identically(setup, tmp_path):
    """Two configurations x two seeds on the tiny model: each run's JSON holds its args, dims, validation history and
    time; a second call runs nothing; the tables rebuilt from the JSON files are the same every time."""
    d, ckpt, data = setup
    X = docs_experiments()
    runs = X.tiny_grid(str(ckpt), str(data))
    res, scratch = tmp_path / "results", tmp_path / "scratch"
    X.run_grid(runs, jobs=2, results=res, scratch=scratch)
    result_files = sorted((res / "tiny").glob("*.json"))
    assert [f.stem for f in result_files] == sorted(r.name for r in runs)
    recs = [json.loads(f.read_text()) for f in result_files]
    for rec in recs:
        assert rec["args"]["args"]["seed"] == rec["seed"] and rec["args"]["args"]["budget"] == 4
        assert len(rec["dims"]) == 4 and [v["step"] for v in rec["val"]] == [0, 2, 4] and rec["seconds"] > 0
        assert {"step", "teacher_loss", "student_loss", "attn_kl"} <= rec["val"][-1].keys()
        assert rec["command"].startswith("python distill.py ")
    by = {(r["group"], r["seed"]): r for r in recs}
    for s in (0, 1):   # paired: seed s validates on the same windows under both allocations
        assert by[("4/Fix", s)]["val"][0]["teacher_loss"] == by[("4/DoF", s)]["val"][0]["teacher_loss"]
    mtimes = [f.stat().st_mtime_ns for f in result_files]
    X.run_grid(runs, jobs=2, results=res, scratch=scratch)
    assert [f.stat().st_mtime_ns for f in result_files] == mtimes
    doc = tmp_path / "results.md"
    doc.write_text("text\n<!-- begin tiny:summary -->\nstale\n<!-- end tiny:summary -->\nmore\n"
                   "<!-- begin tiny:paired -->\n<!-- end tiny:paired -->\nend\n")
    X.rebuild_docs(docs=[doc], results=res, figures=tmp_path)
    first = doc.read_text()
    assert "stale" not in first and "| 4 | DoF | 2 |" in first and "| 4 | DoF − Fix | 2 |" in first
    assert first.startswith("text\n") and "\nmore\n" in first and first.endswith("end\n")
    X.rebuild_docs(docs=[doc], results=res, figures=tmp_path)
    assert doc.read_text() == first and (tmp_path / "curves-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    later = X.Run("tiny", "later", "4/Later", 0, runs[0].flags + ["--init-from", str(scratch / "tiny" / "gone")])
    with pytest.raises(door.ModelError, match=r"^run tiny/later continues the checkpoint \S+gone, which is not here "):
        X.run_grid([later], results=res, scratch=scratch)                # refused before any run, not in a log
    assert not (scratch / "tiny" / "later.log").exists()


FAKE_DISTILL = """
import json, pathlib, sys
root, out = sys.argv[1], pathlib.Path(sys.argv[sys.argv.index("--out-dir") + 1])
out.mkdir(parents=True, exist_ok=True)
n = len(list(out.glob("call*")))
(out / f"call{n}").write_text(sys.argv[-1])
(out / "config.json").write_text(json.dumps({"dims": [4], "data": root + "/data/x", "near": root + "2/x",
                                            "args": {"max_steps": 2}}))
(out / "metrics.json").write_text(json.dumps({"val": [{"step": 2}], "train_seconds": 1.5}))
print(f"greedy continuations of 'The':\\n  teacher: a\\n  student: b{n}")
"""


def test_runner_resumes_a_stopped_run_and_records_paths_relative_to_the_repository(tmp_path, monkeypatch):
    """A run stopped before its JSON keeps its checkpoint: the next execute passes --resume (the first --overwrite),
    and records the continuation of its last attempt (the log is appended to); paths under the repository are
    written relative to it, a sibling folder whose name starts with the repository's is not."""
    X = docs_experiments()
    monkeypatch.setattr(X.Run, "command", lambda self, out: [sys.executable, "-c", FAKE_DISTILL, str(X.ROOT),
                                                             "--out-dir", str(out)])
    run, res, scratch = X.Run("fake", "r0", "4/Fix", 0), tmp_path / "results", tmp_path / "scratch"
    X.execute(run, res, scratch).unlink()                         # stopped after its checkpoint, before its JSON
    rec = json.loads(X.execute(run, res, scratch).read_text())
    assert [(scratch / "fake" / "r0" / f"call{i}").read_text() for i in range(2)] == ["--overwrite", "--resume"]
    assert rec["continuations"] == {"prompt": "'The'", "teacher": "a", "student": "b1"}
    assert rec["args"]["data"] == "data/x" and rec["args"]["near"] == str(X.ROOT) + "2/x"
    assert 0 <= rec["seconds"] < 60 and rec["train_seconds"] == 1.5


SLEEPER = """
import pathlib, signal, sys, time
state = pathlib.Path(sys.argv[1] + ".state")
signal.signal(signal.SIGTERM, lambda *a: (state.write_text("SIGTERM"), sys.exit(143)))
state.write_text("started")
time.sleep(15)
state.write_text("finished")
"""


def test_runner_stopped_sends_sigterm_to_its_running_runs_and_starts_no_other(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM (run_main's KeyboardInterrupt) while runs are running: each running child gets SIGTERM
    (distill.py stops with its last checkpoint whole, which the next --run resumes), no queued run starts, and the
    runner stops at once; it had waited for its children to finish."""
    import threading
    X = docs_experiments()
    monkeypatch.setattr(X.Run, "command", lambda self, out: [sys.executable, "-c", SLEEPER, str(out)])
    runs = [X.Run("sleepy", f"r{i}", "4/Fix", i) for i in range(3)]          # two at a time: r2 waits
    states = lambda: {p.name.split(".")[0]: p.read_text() for p in (tmp_path / "scratch" / "sleepy").glob("*.state")}

    def interrupt():                                                  # once both are running, as run_main's signal
        deadline = time.time() + 60
        while list(states().values()) != ["started"] * 2 and time.time() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)   # as run_main sets it: not ignored, as in
    try:                                                                  # a shell's background job
        threading.Thread(target=interrupt, daemon=True).start()
        t0 = time.time()
        with pytest.raises(KeyboardInterrupt):
            X.run_grid(runs, jobs=2, results=tmp_path / "results", scratch=tmp_path / "scratch")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert time.time() - t0 < 10 and states() == {"r0": "SIGTERM", "r1": "SIGTERM"}
    assert not (tmp_path / "results").exists()


# ==================================================================================================================
# docs/figures.py and docs/experiments.py: misplaced mass, the allocation table, the learning curves

def test_allocation_table_gives_no_share_of_a_gain_between_one_and_two_standard_errors():
    """The measured rule's gain in KL over Fix is 0.011 ± 0.0095 here: above one standard error, within two, so no
    share of it is given."""
    X = docs_experiments()
    rec = lambda rule, s, kl: {"group": f"32/{rule}", "seed": s, "allocation": rule.lower(),
                               "val": [{"student_loss": 5.0, "attn_kl": [kl, kl], "teacher_loss": 3.0}]}
    table = X.allocation_table([rec("Fix", s, 0.8) for s in (1, 2, 3)] +
                               [rec("Measured", s, 0.8 + e) for s, e in ((1, -0.03), (2, 0.0), (3, -0.003))])
    assert "| -0.0110 ± 0.0095 | – |" in table and "is within two standard errors of zero" in table, table


def test_misplaced_mass_is_the_total_variation_between_the_rows():
    """docs/figures.py's misplaced(): the mean over draws and queries of 1/2 sum_j |p^_ij - p_ij|, p the causal
    softmax rows and p^ those of M plain PRF features drawn in turn from the generator, written out."""
    figures = load_script("docs/figures.py")
    q, k = 0.9 * torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got, gen, mask = figures.misplaced(q, k, [2, 16], 3, torch.Generator().manual_seed(7)), \
        torch.Generator().manual_seed(7), torch.ones(12, 12, dtype=torch.bool).tril()
    p = torch.softmax((q @ k.T / 8 ** 0.5).masked_fill(~mask, -math.inf), -1)
    for m, e in zip([2, 16], got):
        tv = []
        for _ in range(3):
            z = torch.randn(1, m, 8, generator=gen, dtype=torch.float64)[0]
            phi = lambda x: (x / 8 ** 0.25 @ z.T - (x / 8 ** 0.25).square().sum(-1, keepdim=True) / 2).exp()
            a = phi(q) @ phi(k).T * mask
            tv.append(0.5 * (a / a.sum(-1, keepdim=True) - p).abs().sum(-1).mean().item())
        assert 0 < e < 1 and e == pytest.approx(np.mean(tv), rel=1e-9)


def test_learning_curve_figure_shades_the_mean_plus_minus_the_seeds_sd(tmp_path, monkeypatch):
    """docs/experiments.py's curves: one line per configuration, shaded mean ± sd (n − 1) over its seeds, as the
    tables' spread."""
    import matplotlib.axes
    X, shaded = docs_experiments(), []
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", lambda self, x, lo, hi, **k: shaded.append((x, lo, hi)))
    losses = [[5.0, 4.0], [6.0, 4.5], [7.0, 5.5]]                                       # (seeds, steps)
    X.curves([{"name": f"r{s}", "group": "4/Fix", "seed": s, "val": [{"step": 2 * i, "student_loss": v,
               "teacher_loss": 3.0, "attn_kl": [0.1]} for i, v in enumerate(ls)]} for s, ls in enumerate(losses)],
             tmp_path / "c.png")
    (x, lo, hi), = shaded
    sd = np.std(losses, 0, ddof=1)
    assert list(x) == [0, 2] and np.allclose(lo, np.mean(losses, 0) - sd) and np.allclose(hi, np.mean(losses, 0) + sd)
