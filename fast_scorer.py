"""The batched, prefix-sharing scorer: evaluate.loglikelihood's numbers with less work (one row per
distinct input, shared prefixes run once into a cache, the LM head only where a token is scored)."""

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

import devices
import model


@dataclass
class Row:
    """One sequence fed to the model, and what is read from it."""
    tokens: list[int]
    # (position, next token, request number)
    targets: list[tuple[int, int, int]] = field(default_factory=list)


def plan_rows(windows) -> list[list[Row]]:
    """Each document's distinct rows: requests with the same input (MMLU's answers) share one."""
    plans, k = [], 0
    for doc in windows:
        rows: dict[tuple[int, ...], Row] = {}
        for inp, targets in doc:
            row = rows.setdefault(tuple(inp), Row(inp))
            row.targets += [(p, t, k) for p, t in targets]
            k += 1
        plans.append(list(rows.values()))
    return plans


class Scores:
    """Per-request sums of log-probabilities and greedy flags, filled batch by batch."""

    def __init__(self, n):
        self.ll = np.zeros(n, dtype=np.float64)
        self.greedy = np.ones(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)

    def add(self, lm, h, targets):
        """h (B, T, C) hidden states; targets [(b, position, next token, request)]. The LM head
        runs once per distinct (b, position) and nowhere else."""
        b, p, tok, req = zip(*targets)
        where = {bp: i for i, bp in enumerate(dict.fromkeys(zip(b, p)))}  # distinct, in order
        bi, pi = (torch.tensor(ix, device=h.device) for ix in zip(*where))
        logp = F.log_softmax(lm.lm_head(h[bi, pi]).float(), dim=-1)                # (N, V)
        at = torch.tensor([where[bp] for bp in zip(b, p)], device=h.device)
        tok = torch.tensor(tok, device=h.device)
        req = np.array(req)
        np.add.at(self.ll, req, logp[at, tok].double().cpu().numpy())
        np.logical_and.at(self.greedy, req, (logp.argmax(-1)[at] == tok).cpu().numpy())
        self.done[req] = True


def forward_rows(lm, rows: list[Row], scores: Scores, device, cache=None):
    """One forward pass: rows right-padded into (B, T) after the cache's prefix, if any."""
    x, _ = padded([(row.tokens, []) for row in rows])
    h = lm.hidden(x.to(device), cache)                                              # (B, T, C)
    scores.add(lm, h, [(b, p, t, k) for b, row in enumerate(rows) for p, t, k in row.targets])


def grouped(items, fits):
    """items in order, in runs that grow while fits(run, next item)."""
    run = []
    for it in items:
        if run and not fits(run, it):
            yield run
            run = []
        run.append(it)
    if run:
        yield run


def batches(items, length, batch_size: int):
    """Items sorted longest first, in batches of at most batch_size items whose right padding stays
    under 10% of their real tokens, but a batch below 256 positions keeps growing: a forward pass
    reads every weight, so a tiny one costs about as much as a small one."""
    def fits(batch, it):
        width = (len(batch) + 1) * length(batch[0])
        real = sum(map(length, batch)) + length(it)
        return len(batch) < batch_size and width <= max(256, 1.1 * real)
    return grouped(sorted(items, key=length, reverse=True), fits)


# --------------------------------------------------------------------------------------------------
# Shared prefixes: a document's rows begin with the same tokens; they run once, with a cache.

def shareable(rows: list[Row]) -> int:
    """How many tokens begin every row of a document, each row keeping at least one of its own (0
    for a single row)."""
    if len(rows) == 1:
        return 0
    columns = list(zip(*(r.tokens[:-1] for r in rows)))
    return next((i for i, column in enumerate(columns) if len(set(column)) > 1), len(columns))


def _take(x, idx):
    """Cache contents, batch dimension (0) indexed by idx: one prefix's state copied to its rows."""
    if torch.is_tensor(x):
        return x.index_select(0, idx)
    if isinstance(x, dict):
        return {key: _take(v, idx) for key, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_take(v, idx) for v in x)
    return x


def run_shared(lm, docs: list[tuple[int, list[Row]]], scores: Scores, batch_size: int, device):
    """Documents (shareable length, rows) whose rows share at least P tokens (P = the smallest
    shareable): those P tokens of every document in one forward pass filling a cache, then the
    rows' remainders in batches of similar length, each continuing from a copy of its document's
    part of the cache."""
    P = min(n for n, _ in docs)
    docs = [rows for _, rows in docs]
    cache = model.Cache(lm.config.n_layer)
    prefixes = torch.tensor([doc[0].tokens[:P] for doc in docs], device=device)
    h = lm.hidden(prefixes, cache)                                                  # (docs, P, C)
    inside = [(d, p, t, k) for d, doc in enumerate(docs) for r in doc for p, t, k in r.targets
              if p < P]
    # positions scored inside the prefix (their hidden state is the same for all the rows)
    if inside:
        scores.add(lm, h, inside)
    rows = [(d, Row(r.tokens[P:], [(p - P, t, k) for p, t, k in r.targets if p >= P]))
            for d, doc in enumerate(docs) for r in doc]
    for batch in batches(rows, lambda dr: len(dr[1].tokens), batch_size):
        which = torch.tensor([d for d, _ in batch], device=device)
        row_cache = model.Cache(lm.config.n_layer)
        row_cache[:] = [_take(layer, which) for layer in cache]
        row_cache.pos = P
        forward_rows(lm, [r for _, r in batch], scores, device, row_cache)


# prefix tokens whose cache is held at once (GPT-2 124M: 12 layers x 2 x 768 floats each)
PREFIX_WINDOW = 4096


def prefix_groups(shared: list[tuple[int, list[Row]]], batch_size: int):
    """Documents (shareable length, rows) sorted by that length, in groups of up to 4 x batch_size
    rows; a group shares the smallest shareable length of its documents, so a document joins only
    if its own is at most 25% longer."""
    def fits(group, doc):
        P = group[0][0]
        rows_fit = sum(len(rows) for _, rows in group) + len(doc[1]) <= 4 * batch_size
        return rows_fit and (len(group) + 1) * P <= PREFIX_WINDOW and doc[0] <= 1.25 * P
    return grouped(sorted(shared, key=lambda doc: doc[0]), fits)


# --------------------------------------------------------------------------------------------------
# The scorer; torchrun's shares put together; the padded batches of fine-tuning.

def requests(rows: list[Row]) -> int:
    """How many requests rows score."""
    return len({k for r in rows for _, _, k in r.targets})


@torch.inference_mode()
def score_windows(lm, windows, batch_size: int = 16, device="cpu", desc: str | None = None,
                  share_prefix: bool = True):
    """(log-likelihood, is_greedy) of every request, one list per document, equal to the plain
    scorer's; windows[d] lists document d's requests as (input tokens, [(position, next token)]).
    Under torchrun each process runs a share of the forward passes (scoring its requests whole),
    and all get every score (gather): exactly what one process computes."""
    alone, shared = [], []
    for rows in plan_rows(windows):
        P = shareable(rows) if share_prefix else 0
        if P:
            shared.append((P, rows))
        else:
            alone += rows
    scores = Scores(sum(len(doc) for doc in windows))
    # rows that share nothing (and MMLU's), then documents with a shared prefix, by its length
    passes = [(partial(forward_rows, lm, batch, scores, device), requests(batch))
              for batch in batches(alone, lambda r: len(r.tokens), batch_size)]
    for docs in prefix_groups(shared, batch_size):
        n = sum(requests(rows) for _, rows in docs)
        passes.append((partial(run_shared, lm, docs, scores, batch_size, device), n))
    passes = devices.shard(passes)
    total = sum(n for _, n in passes)
    with tqdm(total=total, desc=desc, disable=desc is None, unit="req", leave=False) as pbar:
        for run_pass, n in passes:
            run_pass()
            pbar.update(n)
    out, k = [], 0
    for doc in windows:
        out.append([(float(scores.ll[k + j]), bool(scores.greedy[k + j])) if scores.done[k + j]
                    else None for j in range(len(doc))])
        k += len(doc)
    return gather(out)


def gather(scored: list) -> list:
    """Every process's scores (None where another process scored a request) put together: each
    request's score from the process that scored it."""
    shares = devices.all_gather(scored)
    return [[next(r for r in rs if r is not None) for rs in zip(*docs)] for docs in zip(*shares)]


def runs(docs: list, max_requests: int) -> list[list[int]]:
    """Indices of docs (lists of requests) in runs of at most max_requests requests (at least one
    document each)."""
    def fits(run, i):
        return sum(len(docs[j]) for j in run) + len(docs[i]) <= max_requests
    return list(grouped(range(len(docs)), fits))


def padded(windows) -> tuple[torch.Tensor, torch.Tensor]:
    """Harness windows (input tokens, [(position, next token)]) right-padded: inputs (N, T), targets
    (N, T), -1 where nothing is scored. Right padding changes no score: the model is causal."""
    x = pad_sequence([torch.tensor(inp) for inp, _ in windows], batch_first=True)
    y = torch.full_like(x, -1)
    for i, (_, targets) in enumerate(windows):
        for pos, token in targets:
            y[i, pos] = token
    return x, y
