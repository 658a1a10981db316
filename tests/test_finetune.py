"""evaluate.py's fine-tuning (the paper's protocol): the loss, the training, the learning-rate grid, the two
rules for the epoch, the teacher left alone under its student, torchrun and bad input."""

import json
import re

import pytest
import torch

import door
import evaluate
import tasks
from conftest import DATA, load_script, torchrun
from model import GPT

TRAIN = DATA / "train"  # the first 40 documents of ARC-Easy's training and validation splits


def cfg_for(ckpt):
    return evaluate.EvalConfig(model=str(ckpt), device="cpu", batch_size=6)


def fine_tune(ckpt, enc, prompts, epochs, docs_per_step):
    """One task's fine-tuning settings: trained and scored on the same prompts."""
    return evaluate.FineTune(cfg_for(ckpt), enc, "cpu", {"train": prompts, "eval": prompts}, epochs, docs_per_step)


def arc(n, split="train"):
    return tasks.load_task("arc_easy", evaluate.arc, TRAIN, n, split)


def test_batched_loss_and_its_gradient_equal_the_plain_per_document_form(tiny_gpt, enc):
    """All requests of a batch in one right-padded forward pass: the plain form's summed loss and gradient."""
    prompts = arc(5)  # 3 to 5 choices, windows of different lengths
    docs, golds = evaluate.tokenize(enc, prompts), [p.gold for p in prompts]
    params = list(tiny_gpt.parameters())
    plain = sum(evaluate.document_loss(tiny_gpt, doc, gold) for doc, gold in zip(docs, golds))
    plain_grads = torch.autograd.grad(plain, params)
    batched = evaluate.batch_loss(tiny_gpt, docs, golds)
    batched_grads = torch.autograd.grad(batched, params)
    torch.testing.assert_close(batched, plain, rtol=1e-5, atol=1e-5)
    for b, p in zip(batched_grads, plain_grads):
        torch.testing.assert_close(b, p, rtol=1e-4, atol=1e-6)


def test_the_loss_ranks_the_scores_the_scorer_gives(tiny_gpt, enc):
    """document_loss is the cross-entropy of exactly the log-likelihoods that acc ranks."""
    prompt = arc(1)[0]
    doc = evaluate.tokenize(enc, [prompt])[0]
    lls = [evaluate.loglikelihood(tiny_gpt, c, t)[0] for c, t in doc]
    expected = torch.nn.functional.cross_entropy(torch.tensor(lls), torch.tensor(prompt.gold))
    with torch.no_grad():
        got = evaluate.document_loss(tiny_gpt, doc, prompt.gold)
    assert float(got) == pytest.approx(float(expected), rel=1e-5)


def test_fine_tuned_on_its_eval_set_a_tiny_model_reaches_accuracy_one(ckpt, tiny_gpt, enc):
    """Trained on 8 documents and scored on the same 8: about chance before, every one right after."""
    prompts = arc(8)
    zero_shot = evaluate.evaluate_task(tiny_gpt, enc, prompts, cfg_for(ckpt))[0]["acc"]
    result = evaluate.finetune(fine_tune(ckpt, enc, prompts, 5, 4), tiny_gpt, 3e-2)
    assert zero_shot < 0.5 and result["stopped"] is None
    assert result["epochs"][-1]["eval"]["acc"] == 1.0
    assert result["epochs"][-1]["loss"] < result["epochs"][0]["loss"]


def test_fine_tuning_is_seeded(ckpt, tiny_gpt, enc):
    prompts = arc(4)
    runs = [evaluate.finetune(fine_tune(ckpt, enc, prompts, 1, 2), tiny_gpt, 1e-3) for _ in range(2)]
    for r in runs:
        r["epochs"][0].pop("train_seconds")
        r["epochs"][0]["eval"].pop("seconds")
    assert runs[0] == runs[1]


def test_a_non_finite_loss_stops_its_grid_point_with_one_sentence(ckpt, tiny_gpt, enc, capsys):
    prompts = arc(4)
    result = evaluate.finetune(fine_tune(ckpt, enc, prompts, 3, 2), tiny_gpt, 1e30)
    assert re.fullmatch(r"lr 1e\+30: the loss is (nan|inf) in epoch 1; stopped", result["stopped"])
    assert result["stopped"] in capsys.readouterr().out and result["epochs"] == []


def history(*accs):
    """A hand-made run: each epoch's eval acc, and its validation acc where given as a pair."""
    epochs = []
    for i, a in enumerate(accs, 1):
        scored, validation = a if isinstance(a, tuple) else (a, None)
        epochs.append({"epoch": i, "eval": {"acc": scored}})
        if validation is not None:
            epochs[-1]["validation"] = {"acc": validation}
    return epochs


def test_the_papers_rule_and_the_validation_rule_on_a_hand_made_history():
    r = evaluate.rules(history((0.5, 0.8), (0.7, 0.6), (0.6, 0.9)))
    assert r["paper"] == {"epoch": 2, "acc": 0.7}                # the best epoch on the scored split
    assert r["validation"] == {"epoch": 3, "acc": 0.6}           # chosen on validation, reported on the scored split
    # ties: the first; no validation
    assert evaluate.rules(history(0.6, 0.6, 0.5)) == {"paper": {"epoch": 1, "acc": 0.6}}
    assert evaluate.rules(history(0.4)) == {"paper": {"epoch": 1, "acc": 0.4}}            # MMLU's one epoch: the last
    assert evaluate.rules([]) == {}


def test_the_grid_picks_the_lr_whose_teacher_accuracy_is_best_and_reuses_it_for_the_student(ckpt, monkeypatch):
    models = {"teacher": object(), "student": object()}        # stand-ins: finetune_task hands them to finetune
    teacher_accs = {1e-5: [0.3, 0.4], 5e-5: [0.6, 0.5], 1e-4: None, 5e-4: [0.2, 0.55]}  # None: diverged
    calls = []

    def fake(ft, lm, lr, desc=None):
        calls.append((lr, ft.epochs, ft.docs_per_step))
        accs = teacher_accs[lr] if lm is models["teacher"] else [0.45, 0.5]
        if accs is None:
            return {"lr": lr, "epochs": [], "stopped": f"lr {lr:g}: the loss is nan in epoch 1; stopped"}
        return {"lr": lr, "epochs": history(*accs), "stopped": None}
    monkeypatch.setattr(evaluate, "finetune", fake)
    cfg = evaluate.EvalConfig(model=str(ckpt), finetune_epochs=2, finetune_lr="1e-5,5e-5,1e-4,5e-4")
    lrs, epochs, docs_per_step = tasks.finetune_settings(cfg, "gpt2", "arc_easy")
    ft = evaluate.FineTune(cfg, None, "cpu", {}, epochs, docs_per_step)
    out = evaluate.finetune_task(ft, models, "arc_easy", lrs)
    assert out["teacher"]["lr"] == 5e-5 and out["student"]["lr"] == 5e-5
    assert [point["lr"] for point in out["teacher"]["grid"]] == [1e-5, 5e-5, 1e-4, 5e-4]
    assert out["student"]["rules"]["paper"] == {"epoch": 2, "acc": 0.5}
    assert calls[-1] == (5e-5, 2, 64)  # the student: the chosen lr, Table 9's batch size


def test_a_grid_whose_every_rate_diverges_stops_the_run_with_one_sentence(ckpt, monkeypatch):
    """Every lr of the grid made the teacher's loss non-finite: a sentence naming the rates tried, not a task left
    out of the table."""
    def fake(ft, lm, lr, desc=None):
        return {"lr": lr, "epochs": [], "stopped": f"lr {lr:g}: the loss is nan in epoch 1; stopped"}
    monkeypatch.setattr(evaluate, "finetune", fake)
    cfg = evaluate.EvalConfig(model=str(ckpt), finetune_epochs=2)
    ft = evaluate.FineTune(cfg, None, "cpu", {}, 2, 4)
    with pytest.raises(door.ModelError) as e:
        evaluate.finetune_task(ft, {"teacher": object(), "student": object()}, "arc_easy", [1e-5, 1e-3])
    assert str(e.value) == ("arc_easy: every learning rate tried (1e-05, 0.001) made the teacher's loss non-finite; "
                            "pass lower rates with --finetune-lr")


def test_a_diverging_grid_ends_the_command_with_exit_2_and_writes_nothing(ckpt, student, tmp_path, capsys):
    args = ["--device", "cpu", "--model", str(ckpt), "--ckpt", str(student), "--tasks", "arc_easy", "--data-dir",
            str(DATA / "eval"), "--limit", "2", "--train-dir", str(TRAIN), "--finetune-limit", "4",
            "--finetune-batch-size", "2", "--finetune-epochs", "1", "--finetune-lr", "1e30,1e31",
            "--output", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit) as e:
        door.run_main(lambda: evaluate.main(args))
    err = capsys.readouterr().err                                       # after the progress bars, one sentence
    assert e.value.code == 2 and err.count("error") == 1 and err.splitlines()[-1] == (
        "error: arc_easy: every learning rate tried (1e+30, 1e+31) made the teacher's loss non-finite; pass lower "
        "rates with --finetune-lr")
    assert list(tmp_path.iterdir()) == []


def test_defaults_follow_the_papers_tables_8_and_9_and_the_flags_win(ckpt):
    cfg = evaluate.EvalConfig(model=str(ckpt), finetune_epochs=3)
    assert tasks.finetune_settings(cfg, "gpt2", "arc_easy") == ([1e-4], 3, 64)
    assert tasks.finetune_settings(cfg, "neox", "mmlu") == ([5e-6], 1, 32)            # MMLU: one epoch
    assert tasks.finetune_settings(cfg, "llama", "piqa") == ([1e-5], 3, 32)           # llama: ours
    cfg = evaluate.EvalConfig(model=str(ckpt), finetune_epochs=2, finetune_lr="1e-3,1e-4", finetune_batch_size=5)
    assert tasks.finetune_settings(cfg, "gpt2", "mmlu") == ([1e-3, 1e-4], 1, 5)


def test_each_epoch_draws_a_new_order_of_the_training_documents(ckpt, enc, monkeypatch):
    """Every epoch takes each document once, in an order of its own (seeded by --seed and the epoch): an order drawn
    once and reused had shown the model the same batches every epoch."""
    prompts = arc(8)
    tokenized = evaluate.tokenize(enc, prompts)
    seen = []

    def step(ft, lm, optim, docs, golds):
        seen.extend(tokenized.index(doc) for doc in docs)
        return 1.0
    monkeypatch.setattr(evaluate, "finetune_step", step)
    monkeypatch.setattr(evaluate, "score_epoch", lambda ft, lm, epoch, *a: {"epoch": epoch, "eval": {"acc": 0.5}})
    evaluate.finetune(fine_tune(ckpt, enc, prompts, 3, 3), torch.nn.Linear(1, 1), 1e-3)
    orders = [tuple(seen[i:i + 8]) for i in (0, 8, 16)]
    assert len(seen) == 24 and all(sorted(o) == list(range(8)) for o in orders)
    assert len(set(orders)) == 3, orders


def test_the_students_fine_tune_leaves_the_teacher_bit_identical(ckpt, enc):
    """linearize shares every weight with the teacher: fine-tuning the student trains its own copy."""
    teacher = GPT.from_pretrained(ckpt)
    torch.manual_seed(0)
    student = teacher.linearize([8, 8], chunk_size=16)
    before = {k: t.clone() for k, t in teacher.state_dict().items()}
    student_before = {k: t.clone() for k, t in student.state_dict().items()}
    prompts = arc(4)
    result = evaluate.finetune(fine_tune(ckpt, enc, prompts, 1, 2), student, 1e-2)
    assert result["stopped"] is None
    for k, t in teacher.state_dict().items():
        assert torch.equal(t, before[k]), k
    for k, t in student.state_dict().items():
        assert torch.equal(t, student_before[k]), k


def test_the_command_line_writes_both_models_zero_shot_and_fine_tuned(ckpt, student, tmp_path, capsys):
    out = tmp_path / "r.json"
    evaluate.main(["--device", "cpu", "--model", str(ckpt), "--ckpt", str(student), "--tasks", "arc_easy,wsc273",
                   "--data-dir", str(DATA / "eval"), "--limit", "3", "--train-dir", str(TRAIN), "--finetune-limit", "4",
                   "--finetune-epochs", "2", "--finetune-lr", "1e-4,1e-3", "--finetune-batch-size", "2",
                   "--output", str(out)])
    printed = capsys.readouterr().out
    assert "wsc273 has no training split: it is scored zero-shot" in printed
    r = json.loads(out.read_text())
    ft = r["finetune"]
    assert ft["command"].startswith("python evaluate.py --device cpu --model ")
    assert list(ft["tasks"]) == ["arc_easy"] and list(r["results"]) == ["arc_easy", "wsc273"]
    task = ft["tasks"]["arc_easy"]
    assert [p["lr"] for p in task["teacher"]["grid"]] == [1e-4, 1e-3]
    assert task["student"]["lr"] == task["teacher"]["lr"]
    for label in ("teacher", "student"):
        assert task[label]["zero_shot"] == (r if label == "teacher" else r["student"])["results"]["arc_easy"]
        assert [e["epoch"] for e in task[label]["epochs"]] == [1, 2]
        assert set(task[label]["rules"]) == {"paper", "validation"}
        assert task[label]["epochs"][0]["validation"]["n"] == 3 and task[label]["epochs"][0]["eval"]["n"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    table = load_script("docs/experiments.py").finetune_table(r)          # docs/results.md's table of such a file
    assert "| arc_easy | student |" in table and "of the teacher's fine-tuned accuracy" in table


def without_timings(r):
    """The report less what a clock or the launch sets (seconds, the world size, the command's flags)."""
    if isinstance(r, dict):
        return {k: without_timings(v) for k, v in r.items()
                if k not in ("seconds", "train_seconds", "world_size", "output", "command", "loss")}
    if isinstance(r, list):
        return [without_timings(v) for v in r]
    return r


def losses(r):
    return [e["loss"] for m in r["finetune"]["tasks"]["arc_easy"].values() if isinstance(m, dict)
            for e in m.get("epochs", [])]


def test_torchrun_two_processes_equal_one(ckpt, student, tmp_path):
    """Each process trains on a share of every batch and the gradients are averaged: the accuracies equal one
    process's, the losses within float noise."""
    args = ["--model", ckpt, "--ckpt", student, "--tasks", "arc_easy", "--data-dir", DATA / "eval", "--limit", "4",
            "--train-dir", TRAIN, "--finetune-limit", "5", "--finetune-epochs", "2", "--finetune-lr", "1e-3",
            "--finetune-batch-size", "3", "--device", "cpu"]
    evaluate.main([*map(str, args), "--output", str(tmp_path / "one.json")])
    r = torchrun("evaluate.py", *args, "--output", tmp_path / "two.json")
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert without_timings(two) == without_timings(one)
    assert losses(two) == pytest.approx(losses(one), rel=1e-4)


def bad_train_dir(tmp_path):
    """A copy of TRAIN whose training file's second document has no answerKey."""
    bad = tmp_path / "bad"
    bad.mkdir()
    lines = (TRAIN / "arc_easy_train.jsonl").read_text().splitlines()
    doc = json.loads(lines[1])
    del doc["answerKey"]
    (bad / "arc_easy_train.jsonl").write_text("\n".join([lines[0], json.dumps(doc)] + lines[2:]) + "\n")
    return bad


BAD = [  # flags after --model --tasks arc_easy --data-dir --output, and the sentence on stderr
    (["--finetune-epochs", "-1"], r"--finetune-epochs must be a number of at least 0, got -1"),
    (["--finetune-epochs", "1", "--finetune-lr", "0"], r"--finetune-lr must be positive numbers separated by "
                                                       r"commas, got '0'"),
    (["--finetune-epochs", "1", "--finetune-lr", "1e-4,-5e-5"], r"--finetune-lr must be positive numbers separated "
                                                                r"by commas, got '1e-4,-5e-5'"),
    (["--finetune-epochs", "1", "--finetune-lr", "-1e-5"], r"--finetune-lr must be positive numbers separated by "
                                                           r"commas, got '-1e-5'"),   # argparse's: expected one argument
    (["--finetune-epochs", "1", "--finetune-lr", "1e-4,x"], r"--finetune-lr must be positive numbers separated by "
                                                            r"commas, got '1e-4,x'"),
    (["--finetune-epochs", "1", "--finetune-lr", "nan"], r"--finetune-lr must be positive numbers separated by "
                                                         r"commas, got 'nan'"),
    (["--finetune-epochs", "1", "--finetune-lr", "1e-4,1e-3,0.0001"], r"--finetune-lr names a rate twice, got "
                                                                      r"'1e-4,1e-3,0.0001'; pass each rate once"),
    (["--finetune-batch-size", "0"], r"--finetune-batch-size must be a number of at least 1, got 0"),
    (["--finetune-limit", "0"], r"--finetune-limit must be a number of at least 1, got 0"),
    (["--finetune-epochs", "1", "--dtype", "bfloat16"], r"fine-tuning trains float32 weights \(under bf16 "
                                                        r"autocast on CUDA\); drop --dtype"),
    (["--finetune-epochs", "1", "--train-dir", "nowhere"], r"--train-dir \S+nowhere is not a folder; pass the "
                                                           r"folder of <task>_train.jsonl files"),
    (["--finetune-epochs", "1", "--train-dir", "empty"], r"--train-dir \S+empty holds no arc_easy_train.jsonl, "
                                                         r"the training split of arc_easy; add it or drop arc_easy"),
    (["--finetune-epochs", "1", "--train-dir", "bad"], r"\S+bad/arc_easy_train.jsonl line 2: document has no field "
                                                       r"'answerKey'; see tests/data/eval/arc_easy.jsonl"),
    (["--finetune-epochs", "1", "--tasks", "arc_easy,hellaswag"], r"unknown task 'hellaswag'; known tasks: .+"),
    # fine-tuning flags without --finetune-epochs: refused, not ignored
    (["--finetune-lr", "1e-4"], r"--finetune-lr needs --finetune-epochs; pass --finetune-epochs too, or drop "
                                r"--finetune-lr"),
    (["--finetune-batch-size", "8"], r"--finetune-batch-size needs --finetune-epochs; pass --finetune-epochs too, "
                                     r"or drop --finetune-batch-size"),
    (["--train-dir", "bad"], r"--train-dir needs --finetune-epochs; pass --finetune-epochs too, or drop --train-dir"),
    (["--finetune-limit", "5"], r"--finetune-limit needs --finetune-epochs; pass --finetune-epochs too, or drop "
                                r"--finetune-limit"),
]


@pytest.mark.parametrize("flags, sentence", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_fine_tuning_input_is_one_sentence_before_any_work(flags, sentence, ckpt, tmp_path, capsys,
                                                               monkeypatch):
    """Exit code 2, one sentence, no model loaded and nothing written."""
    bad_train_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setattr(tasks, "load_models", lambda *a: pytest.fail("a model was loaded"))
    flags = [str(tmp_path / f) if f in ("nowhere", "empty", "bad") else f for f in flags]
    with pytest.raises(SystemExit) as e:
        door.run_main(lambda: evaluate.main(["--device", "cpu", "--model", str(ckpt), "--tasks", "arc_easy",
                                        "--data-dir", str(DATA / "eval"), "--output", str(tmp_path / "r.json"),
                                        *flags]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.fullmatch("error: " + sentence + r"\n", err), err
    assert sorted(tmp_path.rglob("*")) == before


def test_without_a_train_dir_the_hubs_training_and_validation_splits_are_read(monkeypatch, capsys):
    asked = []

    def hub(name, split=None):
        asked.append((name, split))
        return "the hub", tasks.read_jsonl(TRAIN / "arc_easy_train.jsonl", name)
    monkeypatch.setattr(tasks, "hub_documents", hub)
    scored = arc(2)
    splits = tasks.load_training(evaluate.EvalConfig(finetune_epochs=1, limit=3), {"arc_easy": scored, "wsc273": []},
                                 evaluate.TASKS)
    assert asked == [("arc_easy", "train"), ("arc_easy", "validation")]
    assert list(splits) == ["arc_easy"] and splits["arc_easy"]["eval"] is scored
    assert len(splits["arc_easy"]["train"]) == 40 and len(splits["arc_easy"]["validation"]) == 3
    assert capsys.readouterr().out == "wsc273 has no training split: it is scored zero-shot\n"
    # zero-shot: nothing read
    assert tasks.load_training(evaluate.EvalConfig(), {"arc_easy": scored}, evaluate.TASKS) == {}
