"""CTC-CRF denominator graphs: a token n-gram as an epsilon-free acceptor, composed with
the CTC topology.

The CTC-CRF denominator is the log partition function over every frame path of
(CTC topology o token LM). It is a sum over paths in the log semiring, so the LM must give
each token string its probability exactly once. An ARPA back-off model written as an FST
with epsilon back-off arcs does not: a string reaches the same history both by the n-gram
arc and by the back-off arc and is counted twice. This module builds the LM as an
epsilon-free deterministic acceptor instead, with one of two estimators
(`build_den_graph(estimator=...)`, `trainer.den_lm_estimator`).

**chain** (the default, CAT's): the un-smoothed phone LM of Kaldi's `chain-est-phone-lm
--ngram-order 4 --no-prune-ngram-order 3 --num-extra-lm-states 1000`, which CAT's
`prep_den_lm.sh` runs. Kaldi avoids smoothing to keep the number of transitions small:
a state has arcs only for the tokens the transcripts hold after it.

* **States** are histories (the last `order - 1` symbols of `<s> t1 .. ti`) seen in the
  training transcripts: every one shorter than `no_prune_order` (3: all unigram and
  bigram histories), `<s>`, and the `extra_states` most frequent longer ones (ties: the
  shorter, then by token ids, oldest first, `<s>` after every token). Kaldi keeps the
  long histories whose removal loses the most likelihood; this rule keeps the most
  frequent ones, so the state set is not guaranteed to be Kaldi's.
  A history never occurs more often than its prefix or its suffix, so the kept set is
  closed under both, and the longest kept suffix of (state, token) is the longest kept
  suffix of the whole history.
* **Counts**: each sentence `<s> t1 .. tn </s>` walks the acceptor: at each position the
  state is the longest kept suffix of the history (a pruned history's counts go to it),
  the pair (state, next symbol) is counted, and the token leads to the longest kept
  suffix of (state, token). `p(w | s) = c(s, w) / c(s)` with `</s>` counted as a symbol
  (the final weight); pairs never seen have no arc (probability 0; nothing backs off),
  and states the walk never reaches are dropped.
* **Exact**: the acceptor is deterministic and each state's arcs and final weight sum to
  1 (every state reaches a final one), so the path sum of a string is its probability,
  the product of the ML ratios along its one path, and the mass over all strings is 1.
  A string has at most one path; every training sentence has one.

**kneser-ney**: the project's Kneser-Ney estimator (`cat.lm.ngram`) with the back-off
expanded, an arc for every token at every state (about 17 times the chain graph's arcs
for AISHELL's phones; bench/README.md):

* **States** are the LM's contexts that predict something of their own: the empty
  context, `<s>`, and every n-gram of order < N that is the prefix of a higher-order
  n-gram of the model (a context without extensions predicts exactly like its suffix, so
  it is merged into it). The set is closed under suffixes.
* **Arcs**: every state has one arc per token of the LM's vocabulary, weighted by the
  token's true backed-off probability `p(w | h) = p*(h w)` if the model has the n-gram,
  else `gamma(h) p(w | h')`, and leading to the longest suffix of `h w` that is a state.
  The final weight of a state is `p(</s> | h)`.
* `<unk>` is never emitted: every state's distribution is conditioned on not producing it
  (divided by `1 - p(<unk> | h)`), so the acceptor is a proper distribution over the
  token strings of the model's vocabulary. Tokens the training transcripts never hold have
  no arcs (probability 0).

The acceptor is deterministic and epsilon-free, so the path sum of a string is its
normalised probability, and the denominator graph built from it needs no log-semiring
determinization. Composition with the CTC topology (blank = 0; a token state repeats its
token on a self-loop, a blank leads back to the blank state, a different token is a new
emission) gives states (LM state, blank) and (LM state, last token).

Usage::

    den = build_den_graph(label_sequences, num_classes=V, order=4, extra_states=1000)
    save_den_graph(den, "exp/crf/den_lm.npz", units=tokenizer_pieces)
    den = load_den_graph("exp/crf/den_lm.npz", num_classes=V, units=tokenizer_pieces)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from cat.core.io import PathLike, atomic_write
from cat.lm.ngram import BOS, EOS, UNK, NGramModel, estimate

BLANK = 0
FORMAT = "cat-den-graph-1"


class DenGraphError(ValueError):
    """A denominator graph file that cannot be used (missing, damaged, other tokenizer)."""


@dataclasses.dataclass(frozen=True)
class Fsa:
    """An epsilon-free weighted acceptor in the log semiring (weights are natural logs).

    Arc i goes from `src[i]` to `dst[i]` reading `label[i]` with weight `weight[i]`;
    `final[s]` is the final weight of state s (-inf: not final).
    """

    num_states: int
    start: int
    src: np.ndarray
    dst: np.ndarray
    label: np.ndarray
    weight: np.ndarray
    final: np.ndarray

    @property
    def num_arcs(self) -> int:
        return len(self.src)


@dataclasses.dataclass(frozen=True)
class DenGraph:
    """The token LM (`lm`, labels = token ids >= 1) and CTC topology o LM (`den`, labels =
    token ids with blank 0) for a vocabulary of `num_classes`; `info` records how it was
    built (order, sizes) and `units` the tokenizer's pieces it was built for."""

    num_classes: int
    lm: Fsa
    den: Fsa
    info: dict
    units_digest: str = ""

    def lm_log_prob(self, tokens: Sequence[int]) -> float:
        """Natural-log probability of a token string (with `</s>`) under the acceptor."""
        table = self.lm_table
        state, total = self.lm.start, 0.0
        for token in tokens:
            if not 0 < token < self.num_classes or table[0][state, token] < 0:
                return -math.inf
            total += table[1][state, token]
            state = int(table[0][state, token])
        return total + float(self.lm.final[state])


    @functools.cached_property
    def lm_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Dense (next state, log weight) [LM states, classes] of the acceptor, -1 / -inf
        where it has no arc."""
        lm = self.lm
        nxt = np.full((lm.num_states, self.num_classes), -1, np.int64)
        wgt = np.full((lm.num_states, self.num_classes), -np.inf)
        nxt[lm.src, lm.label] = lm.dst
        wgt[lm.src, lm.label] = lm.weight
        return nxt, wgt


# ------------------------------------------------------------------ the token LM


def _backed_off(model: NGramModel, extra_states: int | None = None, no_prune_order: int = 3
                ) -> tuple[list[tuple[int, ...]], dict, np.ndarray, np.ndarray]:
    """States (contexts, as tuples of LM vocabulary ids), their index, and per state the
    natural-log p(w | h) over the LM vocabulary and the next state of each w."""
    order = model.order
    vocab_size = len(model.vocab)
    bos, _eos, unk = (model.vocab.index(t) for t in (BOS, EOS, UNK))
    log_prob: dict[tuple[int, ...], float] = {}
    backoff: dict[tuple[int, ...], float] = {}
    children: dict[tuple[int, ...], list[int]] = {}
    for n in range(1, order + 1):
        grams = model.grams[n - 1].tolist()
        for row, p, b in zip(grams, model.log10_prob[n - 1].tolist(),
                             model.log10_backoff[n - 1].tolist(), strict=True):
            gram = tuple(row)
            log_prob[gram] = p * math.log(10.0)
            backoff[gram] = b * math.log(10.0)
            children.setdefault(gram[:-1], []).append(gram[-1])
    # Contexts with extensions (closed under suffixes), shortest first, plus <s>.
    contexts = {h for h in children if len(h) < order}
    if extra_states is not None:
        # Kaldi's phone-LM rule: every context shorter than no_prune_order - 1 stays, of
        # the longer ones the extra_states most frequent (adjusted counts).
        counts = {tuple(row): c for n in range(1, order)
                  for row, c in zip(model.grams[n - 1].tolist(),
                                    model.adjusted_counts[n - 1].tolist(), strict=True)}
        longer = sorted((h for h in contexts if len(h) >= no_prune_order),
                        key=lambda h: (-counts.get(h, 0), h))
        contexts -= set(longer[extra_states:])
    contexts.add(())
    contexts.add((bos,))
    states = sorted(contexts, key=lambda h: (len(h), h))
    index = {h: i for i, h in enumerate(states)}
    probs = np.empty((len(states), vocab_size))
    nexts = np.empty((len(states), vocab_size), np.int64)
    for i, h in enumerate(states):
        if h:
            parent = index[h[1:]]
            probs[i] = probs[parent] + backoff.get(h, 0.0)
            nexts[i] = nexts[parent]
        else:
            probs[i] = -np.inf
            nexts[i] = 0
        for w in children.get(h, ()):
            probs[i, w] = log_prob[(*h, w)]
            longer = (*h, w)[-(order - 1):] if order > 1 else ()
            if longer in index:
                nexts[i, w] = index[longer]
    probs[:, bos] = -np.inf
    # Condition on never emitting <unk>: divide by 1 - p(<unk> | h).
    with np.errstate(divide="ignore"):
        rest = np.log1p(-np.exp(probs[:, unk]))
    probs[:, unk] = -np.inf
    probs -= rest[:, None]
    return states, index, probs, nexts


def token_lm_acceptor(model: NGramModel, num_classes: int,
                      extra_states: int | None = None) -> Fsa:
    """The epsilon-free deterministic acceptor of `model`, whose vocabulary holds token ids
    as decimal strings (1 .. num_classes - 1; see the module docstring). With
    `extra_states`, contexts of 3 tokens or more are kept only for the `extra_states` most
    frequent ones (the others predict as their longest kept suffix); the acceptor stays a
    normalised distribution."""
    states, index, probs, nexts = _backed_off(model, extra_states)
    eos = model.vocab.index(EOS)
    columns, labels = [], []
    for w, token in enumerate(model.vocab):
        if token in (BOS, EOS, UNK):
            continue
        if not token.isdigit() or not 0 < int(token) < num_classes:
            raise ValueError(f"token LM word {token!r} is not a token id in 1..{num_classes - 1}")
        columns.append(w)
        labels.append(int(token))
    columns_a = np.asarray(columns, np.int64)
    weights = probs[:, columns_a]
    keep = np.isfinite(weights)
    src, col = np.nonzero(keep)
    return Fsa(num_states=len(states), start=index[(model.vocab.index(BOS),)],
               src=src.astype(np.int64), dst=nexts[src, columns_a[col]].astype(np.int64),
               label=np.asarray(labels, np.int64)[col], weight=weights[src, col],
               final=probs[:, eos].copy())


# ------------------------------------------------------------ the chain (Kaldi) token LM

ESTIMATORS = ("chain", "kneser-ney")


def _history_codes(label_seqs: Iterable[Sequence[int]], num_classes: int, order: int
                   ) -> tuple[np.ndarray, np.ndarray, int]:
    """Every predicting position of the sentences `<s> t1 .. tn` (n + 1 per sentence):
    `codes[L, p]` is the history of length L (0 .. order - 1) ending at position p as an
    integer (digits in base B = num_classes + 1, the newest symbol lowest; tokens are
    1 .. V - 1, `<s>` is V; -1 where the sentence is shorter than L), and `nexts[p]` the
    symbol that follows (a token, or 0 for `</s>`)."""
    base = num_classes + 1
    if float(base) ** order >= 2.0 ** 62:
        raise ValueError(f"order {order} over {num_classes} classes: histories do not fit "
                         f"64-bit codes; lower the order")
    parts = [np.asarray(seq, np.int64) for seq in label_seqs]
    if not parts:
        raise ValueError("no label sequences to estimate the token LM from")
    tokens = np.concatenate(parts)
    bad = tokens[(tokens < 1) | (tokens >= num_classes)]
    if bad.size:
        raise ValueError(f"label {bad[0]} is outside 1..{num_classes - 1}")
    lengths_a = np.asarray([part.size + 1 for part in parts], np.int64)
    starts = np.cumsum(lengths_a) - lengths_a
    symbols = np.empty(int(lengths_a.sum()), np.int64)
    symbols[starts] = num_classes  # <s>
    body = np.ones(symbols.size, bool)
    body[starts] = False
    symbols[body] = tokens
    nexts = np.zeros(symbols.size, np.int64)  # </s> after a sentence's last position
    last = starts + lengths_a - 1
    follows = np.ones(symbols.size, bool)
    follows[last] = False
    nexts[follows] = symbols[1:][follows[:-1]]
    offset = np.arange(symbols.size) - np.repeat(starts, lengths_a)
    codes = np.full((order, symbols.size), -1, np.int64)
    codes[0] = 0
    for length in range(1, order):
        prev = np.concatenate([[-1], codes[length - 1][:-1]])
        valid = offset >= length - 1
        codes[length][valid] = prev[valid] * base + symbols[valid] if length > 1 \
            else symbols[valid]
    return codes, nexts, base


def _longest_kept_suffix(code: np.ndarray, kept: np.ndarray, base: int, order: int
                         ) -> np.ndarray:
    """Per history code (of length <= order - 1), its longest suffix in sorted `kept`."""
    out = np.full(code.shape, -1, np.int64)
    for length in range(order - 1, -1, -1):
        suffix = code % base ** length if length else np.zeros_like(code)
        pos = np.minimum(np.searchsorted(kept, suffix), len(kept) - 1)
        hit = (out < 0) & (kept[pos] == suffix)
        out[hit] = suffix[hit]
    return out


def chain_lm_acceptor(label_seqs: Iterable[Sequence[int]], num_classes: int, order: int = 4,
                      no_prune_order: int = 3, extra_states: int | None = 1000) -> Fsa:
    """The deterministic acceptor of the un-smoothed maximum-likelihood token LM of
    `label_seqs` (token ids 1 .. num_classes - 1), as Kaldi's `chain-est-phone-lm` builds
    it for CAT (see the module docstring): states are the histories seen of fewer than
    `no_prune_order` symbols plus the `extra_states` most frequent longer ones (None: all),
    arcs only for the (state, token) pairs the transcripts hold, weighted by their
    relative counts."""
    if order < 1 or no_prune_order < 1:
        raise ValueError(f"order {order}, no_prune_order {no_prune_order}: both must be "
                         f"at least 1")
    codes, nexts, base = _history_codes(label_seqs, num_classes, order)
    # Histories and how often each predicts something; codes of length L lie in
    # [B^(L-1), B^L), so sorting by code sorts by length first.
    seen, counts = np.unique(codes[codes >= 0], return_counts=True)
    length = np.zeros(seen.size, np.int64)
    for n in range(1, order):
        length[seen >= base ** (n - 1)] = n
    keep = length < no_prune_order
    keep |= seen == num_classes  # the <s> state (a history of length 1)
    if extra_states is None:
        keep[:] = True
    else:
        # The most frequent longer histories; ties go to the shorter one, then the
        # smaller code. A history never outnumbers its prefix or its suffix, which win
        # ties against it, so the kept set stays closed under prefixes and suffixes, and
        # then the longest kept suffix of (state, token) is the longest kept suffix of
        # the whole history: the walk below and the arcs agree.
        longer = np.flatnonzero(~keep)
        ranked = longer[np.lexsort((seen[longer], length[longer], -counts[longer]))]
        keep[ranked[:extra_states]] = True
    kept = seen[keep]
    # The walk: the state at each position, and the one its symbol leads to.
    whole = codes[0]
    for n in range(1, order):
        whole = np.where(codes[n] >= 0, codes[n], whole)
    state = _longest_kept_suffix(whole, kept, base, order)
    token = nexts > 0
    top = base ** (order - 1) if order > 1 else 1
    dest = _longest_kept_suffix((state[token] * base + nexts[token]) % top, kept, base, order)
    after = np.flatnonzero(token) + 1
    if not np.array_equal(dest, state[after]):
        raise RuntimeError("chain LM: the arcs' destinations disagree with the walk")
    states, state_id = np.unique(state, return_inverse=True)
    pair, first, pair_count = np.unique(state_id * base + nexts, return_index=True,
                                        return_counts=True)
    pair_state, pair_symbol = pair // base, pair % base
    total = np.bincount(pair_state, weights=pair_count, minlength=states.size)
    log_ratio = np.log(pair_count) - np.log(total[pair_state])
    final = np.full(states.size, -np.inf)
    is_end = pair_symbol == 0
    final[pair_state[is_end]] = log_ratio[is_end]
    arcs = ~is_end
    dest_of = np.full(state.size, -1, np.int64)
    dest_of[token] = np.searchsorted(states, dest)
    start = int(np.searchsorted(states, state[0]))
    return Fsa(num_states=int(states.size), start=start,
               src=pair_state[arcs].astype(np.int64),
               dst=dest_of[first[arcs]].astype(np.int64),
               label=pair_symbol[arcs].astype(np.int64), weight=log_ratio[arcs],
               final=final)


def ctc_compose(lm: Fsa, num_classes: int) -> Fsa:
    """CTC topology o `lm`: blank states (s, blank) are 0 .. S-1; a token state (s, k) is
    entered by emitting k into LM state s. Labels are token ids, blank = 0."""
    num_lm = lm.num_states
    # Token states: the distinct (destination, label) pairs of LM arcs.
    pair = lm.dst * num_classes + lm.label
    pairs, arc_node = np.unique(pair, return_inverse=True)
    node_state, node_label = pairs // num_classes, pairs % num_classes
    node_id = num_lm + np.arange(len(pairs))
    arc_node = num_lm + arc_node
    # LM arcs grouped by source state (CSR), to expand the arcs leaving each token state.
    order = np.argsort(lm.src, kind="stable")
    starts = np.searchsorted(lm.src[order], np.arange(num_lm + 1))
    counts = starts[1:] - starts[:-1]
    per_node = counts[node_state]
    rep_node = np.repeat(np.arange(len(pairs)), per_node)
    offsets = np.arange(per_node.sum()) - np.repeat(np.cumsum(per_node) - per_node, per_node)
    rep_arc = order[starts[node_state][rep_node] + offsets]
    different = lm.label[rep_arc] != node_label[rep_node]
    rep_node, rep_arc = rep_node[different], rep_arc[different]
    blank_states = np.arange(num_lm)
    zeros_b, zeros_n = np.zeros(num_lm), np.zeros(len(pairs))
    src = np.concatenate([blank_states, lm.src, node_id, node_id, node_id[rep_node]])
    dst = np.concatenate([blank_states, arc_node, node_id, node_state, arc_node[rep_arc]])
    label = np.concatenate([np.full(num_lm, BLANK), lm.label, node_label,
                            np.full(len(pairs), BLANK), lm.label[rep_arc]])
    weight = np.concatenate([zeros_b, lm.weight, zeros_n, zeros_n, lm.weight[rep_arc]])
    final = np.concatenate([lm.final, lm.final[node_state]])
    return Fsa(num_states=num_lm + len(pairs), start=lm.start, src=src.astype(np.int64),
               dst=dst.astype(np.int64), label=label.astype(np.int64), weight=weight,
               final=final)


def units_digest(units: Sequence[str]) -> str:
    """A short fingerprint of a tokenizer's pieces (id order matters)."""
    return hashlib.sha256("\n".join(units).encode("utf-8")).hexdigest()[:16]


def build_den_graph(label_seqs: Iterable[Sequence[int]], num_classes: int, order: int = 4,
                    units: Sequence[str] | None = None,
                    discount_fallback: tuple[float, float, float] | None = (0.5, 1.0, 1.5),
                    extra_states: int | None = None, estimator: str = "chain") -> DenGraph:
    """Estimate a token `order`-gram on `label_seqs` (token ids, blank never) and build the
    denominator graph. `estimator`: "chain", the un-smoothed LM of Kaldi's
    `chain-est-phone-lm` as CAT runs it (histories of 3 symbols or more: the
    `extra_states` most frequent; None keeps them all), or "kneser-ney", the project's
    estimator with its back-off expanded (`discount_fallback` applies to it only)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator {estimator!r}: expected one of {', '.join(ESTIMATORS)}")
    seqs = [list(seq) for seq in label_seqs]
    if not seqs:
        raise ValueError("no label sequences to estimate the token LM from")
    info: dict = {"estimator": estimator, "order": order, "extra_states": extra_states,
                  "sentences": len(seqs)}
    if estimator == "chain":
        lm = chain_lm_acceptor(seqs, num_classes, order, extra_states=extra_states)
        info["no_prune_order"] = 3
    else:
        sentences = [[str(t) for t in seq] for seq in seqs]
        for seq in sentences:
            for token in seq:
                if not 0 < int(token) < num_classes:
                    raise ValueError(f"label {token} is outside 1..{num_classes - 1}")
        model = estimate(sentences, order, discount_fallback=discount_fallback)
        lm = token_lm_acceptor(model, num_classes, extra_states)
        info["ngrams"] = [len(g) for g in model.grams]
    den = ctc_compose(lm, num_classes)
    info.update({"lm_states": lm.num_states, "lm_arcs": lm.num_arcs,
                 "den_states": den.num_states, "den_arcs": den.num_arcs})
    return DenGraph(num_classes, lm, den, info, units_digest(units) if units else "")


# --------------------------------------------------------------------------- files

_FIELDS = ("src", "dst", "label", "weight", "final")


def save_den_graph(graph: DenGraph, path: PathLike) -> None:
    """Write `graph` as one .npz (atomically)."""
    arrays = {}
    for name, fsa in (("lm", graph.lm), ("den", graph.den)):
        for field in _FIELDS:
            arrays[f"{name}_{field}"] = getattr(fsa, field)
        arrays[f"{name}_meta"] = np.asarray([fsa.num_states, fsa.start], np.int64)
    header = {"format": FORMAT, "num_classes": graph.num_classes, "info": graph.info,
              "units_digest": graph.units_digest}
    arrays["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8)
    with atomic_write(path, "wb") as f:
        np.savez(f, **arrays)


#: What reading a damaged, truncated or foreign file raises (zip, npy, JSON, members).
_UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)
_ZIP_MAGIC = b"PK\x03\x04"


def _read_arrays(path: Path) -> tuple[dict, dict[str, Fsa]]:
    """The header and the two acceptors of a graph file (every member read in full, so
    that a damaged one fails here); never unpickles anything."""
    with open(path, "rb") as f:
        magic = f.read(len(_ZIP_MAGIC))
    if magic != _ZIP_MAGIC:
        raise ValueError("empty file" if not magic else "not an .npz (zip) file")
    with np.load(path, allow_pickle=False) as data:
        try:
            header = json.loads(bytes(data["header"]).decode("utf-8"))
            fsas = {}
            for name in ("lm", "den"):
                meta = data[f"{name}_meta"]
                fsas[name] = Fsa(int(meta[0]), int(meta[1]),
                                 *(data[f"{name}_{field}"] for field in _FIELDS))
        except ValueError as error:
            if "pickle" in str(error):  # numpy's advice to load it anyway is not given
                raise ValueError("a member holds pickled Python objects") from None
            raise
    if not isinstance(header, dict):
        raise ValueError(f"header {header!r} is not an object")
    return header, fsas


def load_den_graph(path: PathLike, num_classes: int | None = None,
                   units: Sequence[str] | None = None) -> DenGraph:
    """Read a graph written by `save_den_graph`; checks it fits `num_classes` and, when
    given, the tokenizer's `units`. A missing, damaged or truncated file, or one of another
    tokenizer, raises DenGraphError naming the file and how to rebuild it (stage 2)."""
    path = Path(path)
    if not path.is_file():
        raise DenGraphError(f"{path}: denominator graph (trainer.den_lm) does not exist; "
                            f"build it with stage 2 of the recipe (utils/asr.sh) or "
                            f"`python -m cat.graph.den_graph`")
    try:
        header, fsas = _read_arrays(path)
    except _UNREADABLE as error:
        raise DenGraphError(
            f"{path}: not a readable denominator graph file, damaged or truncated "
            f"({type(error).__name__}: {error}); rebuild it: remove it and run stage 2 of "
            f"the recipe again (bash run.sh --stage 2 --stop_stage 2 --exp <exp dir>), or "
            f"build it with python -m cat.graph.den_graph") from None
    if header.get("format") != FORMAT:
        raise DenGraphError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    graph = DenGraph(int(header["num_classes"]), fsas["lm"], fsas["den"], header["info"],
                     header.get("units_digest", ""))
    if num_classes is not None and graph.num_classes != num_classes:
        raise DenGraphError(f"{path}: built for {graph.num_classes} classes, the model has "
                            f"{num_classes}: it belongs to another tokenizer; rebuild it")
    if units is not None and graph.units_digest and graph.units_digest != units_digest(units):
        raise DenGraphError(f"{path}: built for another tokenizer (units digest "
                            f"{graph.units_digest}, this tokenizer's is "
                            f"{units_digest(units)}); rebuild it")
    return graph
