"""The CTC-CRF loss: batched forward-backward over weighted acceptors, CPU and CUDA.

For log-potentials `x` [B, T, V] (the network's log-softmax output, blank = 0), a label
sequence `y` and the denominator graph `D` = CTC topology o token LM
(`cat.graph.denominator`)::

    log p(y | x) = log sum_{pi in CTC(y)} exp(sum_t x[t, pi_t]) + log P_LM(y)
                   - log sum_{pi in D}    exp(sum_t x[t, pi_t] + LM weight of pi)
    loss         = -log p(y | x) + lamb * CTC(y)           (CAT's `lamb`)
                 = -(1 + lamb) * num_ctc - log P_LM(y) + log Z_den

`log P_LM(y)` does not depend on `x`; it is kept so that the loss is the CRF's negative
log-likelihood. `GraphLogSum` computes both path sums with an explicit backward from
forward-backward occupancies, so memory stays at the forward variables, O(frames x
states) per utterance:

* the numerator over the CTC graph of each label sequence (a padded batch of 2U+1-state
  graphs) in the log semiring, per arc (`Arcs`);
* the denominator, one graph shared by the batch, as a transition matrix over states that
  are each entered by one label (`DenMatrix`): a frame is a sparse matrix product and a
  product with the frame's emissions, in the probability semiring with per-frame scales;
  the gradient is each state's posterior summed onto its label. Its cost is the graph's
  arcs x the batch per frame, so the graph's size decides the speed
  (`cat.graph.denominator`, bench/crf_loss.py).

Utterances whose label sequence has no CTC path (too few frames) get loss 0 and no
gradient; `infeasible` reports them. A label sequence the token LM gives probability 0
(an n-gram the LM's text never holds, e.g. a dev transcript under the un-smoothed chain
estimator, or a token it never saw) keeps its loss without the `log P_LM(y)` term, which
does not depend on x: the dev loss then still compares checkpoints on every utterance.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from cat.graph.denominator import DenGraph, Fsa

NEG_INF = float("-inf")
# The shared denominator graph: "matrix" (`DenMatrix`, probability semiring with per-frame
# scales, sparse matrix products) or "arcs" (the log-semiring arc engine of the numerator;
# exact and about two orders of magnitude slower: tests and bench/crf_loss.py compare them).
DENOMINATOR = "matrix"


def _scatter_logsumexp(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """out[b, j] = logsumexp of values[b, i] over i with index[b, i] == j (-inf if none)."""
    batch = values.size(0)
    peak = torch.full((batch, size), NEG_INF, dtype=values.dtype, device=values.device)
    peak = peak.scatter_reduce(1, index, values, reduce="amax", include_self=True)
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    summed = torch.zeros_like(peak).scatter_add(1, index, torch.exp(values - safe.gather(1, index)))
    return torch.log(summed) + safe


class Arcs:
    """Arc arrays on a device: [1, A] (one graph shared by the batch) or [B, A]."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, label: torch.Tensor,
                 weight: torch.Tensor, start: torch.Tensor, final: torch.Tensor,
                 num_states: int) -> None:
        self.src, self.dst, self.label, self.weight = src, dst, label, weight
        self.start, self.final, self.num_states = start, final, num_states

    @classmethod
    def shared(cls, fsa: Fsa, device: torch.device, dtype: torch.dtype) -> Arcs:
        def long(a: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.long, device=device)[None]
        return cls(long(fsa.src), long(fsa.dst), long(fsa.label),
                   torch.as_tensor(fsa.weight, dtype=dtype, device=device)[None],
                   torch.tensor([fsa.start], device=device),
                   torch.as_tensor(fsa.final, dtype=dtype, device=device)[None],
                   fsa.num_states)

    def expanded(self, batch: int) -> tuple[torch.Tensor, ...]:
        size = (batch, self.src.size(1))
        return (self.src.expand(size), self.dst.expand(size), self.label.expand(size),
                self.weight.expand(size))


def ctc_graphs(labels: torch.Tensor, label_lens: torch.Tensor, dtype: torch.dtype) -> Arcs:
    """The CTC graphs of a padded label batch: states 0, 2, .. 2U are blanks, 2u+1 emits
    label u; padded arcs have weight -inf."""
    batch, width = labels.shape
    device = labels.device
    states = 2 * width + 1
    s = torch.arange(states, device=device)
    lab = torch.zeros(batch, states, dtype=torch.long, device=device)
    lab[:, 1::2] = labels
    used = s[None, :] < 2 * label_lens[:, None] + 1
    # self-loops, steps to the next state, skips over a blank between different labels
    loop_src = s.expand(batch, states)
    step_src = s[:-1].expand(batch, states - 1)
    skip_src = s[1:-2:2].expand(batch, max(width - 1, 0))
    skip_ok = (lab[:, 1:-2:2] != lab[:, 3::2]) & used[:, 3::2]
    src = torch.cat([loop_src, step_src, skip_src], 1)
    dst = torch.cat([loop_src, step_src + 1, skip_src + 2], 1)
    ok = torch.cat([used, used[:, 1:], skip_ok], 1)
    label = lab.gather(1, dst)
    weight = torch.where(ok, torch.zeros((), dtype=dtype, device=device),
                         torch.full((), NEG_INF, dtype=dtype, device=device))
    last = 2 * label_lens[:, None]
    is_final = (s[None, :] == last) | ((s[None, :] == last - 1) & (label_lens[:, None] > 0))
    final = torch.where(is_final, torch.zeros((), dtype=dtype, device=device),
                        torch.full((), NEG_INF, dtype=dtype, device=device))
    return Arcs(src, dst, label, weight, torch.zeros(1, dtype=torch.long, device=device),
                final, states)


def _forward(x: torch.Tensor, lengths: torch.Tensor, arcs: Arcs
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(alphas [T+1, B, S], log Z [B])."""
    batch, frames, _ = x.shape
    src, dst, label, weight = arcs.expanded(batch)
    alphas = x.new_full((frames + 1, batch, arcs.num_states), NEG_INF)
    alphas[0].scatter_(1, arcs.start.expand(batch)[:, None], 0.0)
    for t in range(frames):
        scores = alphas[t].gather(1, src) + weight + x[:, t].gather(1, label)
        new = _scatter_logsumexp(scores, dst, arcs.num_states)
        alphas[t + 1] = torch.where((t < lengths)[:, None], new, alphas[t])
    log_z = torch.logsumexp(alphas[frames] + arcs.final.expand(batch, -1), dim=1)
    return alphas, log_z


def _occupancies(x: torch.Tensor, lengths: torch.Tensor, arcs: Arcs, alphas: torch.Tensor,
                 log_z: torch.Tensor) -> torch.Tensor:
    """d log Z / d x [B, T, V]: per frame, the summed posterior of the arcs of each label."""
    batch, frames, _ = x.shape
    src, dst, label, weight = arcs.expanded(batch)
    grad = torch.zeros_like(x)
    beta = arcs.final.expand(batch, -1).clone()
    ok = torch.isfinite(log_z)
    norm = torch.where(ok, log_z, torch.zeros_like(log_z))[:, None]
    for t in range(frames - 1, -1, -1):
        live = (t < lengths) & ok
        ahead = weight + x[:, t].gather(1, label) + beta.gather(1, dst)
        post = torch.exp(alphas[t].gather(1, src) + ahead - norm)
        post = torch.where(live[:, None], post, torch.zeros_like(post))
        grad[:, t].scatter_add_(1, label, post)
        new = _scatter_logsumexp(ahead, src, arcs.num_states)
        beta = torch.where((t < lengths)[:, None], new, beta)
    return grad


class DenMatrix:
    """A shared graph whose states are each entered by one label (the denominator: CTC
    topology o token LM, where a blank state is entered by blank and a token state by its
    token) as a transition matrix: one frame of the forward pass is then
    `alpha' = (W^T alpha) * emission[label of each state]`, a sparse matrix product over
    the batch instead of per-arc gathers and scatters.

    Runs in the probability semiring with a scale per frame (the forward variables are
    divided by their maximum, the logs of the divisors kept apart), as Kaldi's chain
    denominator does; `W` holds exp(arc weight), parallel arcs summed.
    """

    def __init__(self, fsa: Fsa, device: torch.device, dtype: torch.dtype) -> None:
        states = fsa.num_states
        label = np.full(states, -1, np.int64)
        label[fsa.dst] = fsa.label
        if np.any(label[fsa.dst] != fsa.label):
            raise ValueError("the graph has a state entered by two labels; DenMatrix needs "
                             "one label per state (CTC topology o an acceptor has it)")
        label[label < 0] = 0  # never entered: no mass reaches it
        self.num_states, self.start = states, int(fsa.start)
        self.state_label = torch.as_tensor(label, device=device)
        values = torch.as_tensor(np.exp(fsa.weight), dtype=dtype, device=device)
        src = torch.as_tensor(fsa.src, device=device)
        dst = torch.as_tensor(fsa.dst, device=device)

        def csr(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            # int32 indices: the sparse kernels take them as they are (int64 ones are
            # converted on every product)
            with warnings.catch_warnings():
                for message in ("Sparse CSR tensor support", "Sparse invariant checks"):
                    warnings.filterwarnings("ignore", message=message)
                coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), values,
                                              (states, states), check_invariants=True)
                matrix = coo.coalesce().to_sparse_csr()
                return torch.sparse_csr_tensor(matrix.crow_indices().int(),
                                               matrix.col_indices().int(), matrix.values(),
                                               matrix.shape)
        self.to_dst = csr(dst, src)   # W^T: row = destination state
        self.to_src = csr(src, dst)   # W:   row = source state
        final = torch.as_tensor(fsa.final, dtype=dtype, device=device)
        self.final_peak = final.max()
        self.final = torch.exp(final - self.final_peak)

    def emission(self, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp(x_t - peak) per state [S, B], peak [B]) for one frame x_t [B, V]."""
        peak = x_t.max(dim=1).values
        return torch.exp(x_t - peak[:, None]).index_select(1, self.state_label).t(), peak


def _den_forward(x: torch.Tensor, lengths: torch.Tensor, den: DenMatrix
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled forward variables [T+1, S, B], log Z [B]) of the shared graph `den`."""
    batch, frames, _ = x.shape
    alphas = x.new_zeros((frames + 1, den.num_states, batch))
    alphas[0, den.start] = 1.0
    log_scale = x.new_zeros(batch)
    for t in range(frames):
        emit, peak = den.emission(x[:, t])
        new = (den.to_dst @ alphas[t]) * emit
        norm = new.max(dim=0).values
        norm = torch.where(norm > 0, norm, torch.ones_like(norm))
        live = t < lengths
        alphas[t + 1] = torch.where(live[None, :], new / norm, alphas[t])
        log_scale = log_scale + torch.where(live, peak + torch.log(norm),
                                            torch.zeros_like(norm))
    total = (alphas[frames] * den.final[:, None]).sum(dim=0)
    return alphas, torch.log(total) + log_scale + den.final_peak


def _den_occupancies(x: torch.Tensor, lengths: torch.Tensor, den: DenMatrix,
                     alphas: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    """d log Z / d x [B, T, V] from `_den_forward`'s alphas: per frame, the posterior of
    each state (alpha x beta, normalised over the frame's states) summed onto its label."""
    batch, frames, classes = x.shape
    grad = torch.zeros_like(x)
    beta = den.final[:, None].expand(-1, batch).clone()
    ok = torch.isfinite(log_z)
    for t in range(frames - 1, -1, -1):
        live = t < lengths
        share = alphas[t + 1] * beta
        total = share.sum(dim=0)
        use = live & ok & (total > 0)
        post = share / torch.where(use, total, torch.ones_like(total))
        post = torch.where(use[None, :], post, torch.zeros_like(post))
        grad[:, t] = post.new_zeros(classes, batch).index_add_(0, den.state_label, post).t()
        emit, _ = den.emission(x[:, t])
        new = den.to_src @ (emit * beta)
        norm = new.max(dim=0).values
        new = new / torch.where(norm > 0, norm, torch.ones_like(norm))
        beta = torch.where(live[None, :], new, beta)
    return grad


class GraphLogSum(torch.autograd.Function):
    """log Z [B] of acceptors over the frames of x, with an explicit backward from
    forward-backward occupancies: `Arcs` (per-utterance or shared graphs) in the log
    semiring, a `DenMatrix` in the probability semiring with per-frame scales."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: torch.Tensor, graph: Arcs | DenMatrix
                ) -> torch.Tensor:
        if isinstance(graph, DenMatrix):
            alphas, log_z = _den_forward(x.detach(), lengths, graph)
        else:
            alphas, log_z = _forward(x.detach(), lengths, graph)
        ctx.save_for_backward(x, lengths, alphas, log_z)
        ctx.graph = graph
        return log_z

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, lengths, alphas, log_z = ctx.saved_tensors
        occupancies = _den_occupancies if isinstance(ctx.graph, DenMatrix) else _occupancies
        occupancy = occupancies(x.detach(), lengths, ctx.graph, alphas, log_z)
        return occupancy * grad_out[:, None, None], None, None


def graph_log_sum(x: torch.Tensor, lengths: torch.Tensor, graph: Arcs | DenMatrix
                  ) -> torch.Tensor:
    """Differentiable log partition function of `graph` over x [B, T, V]."""
    return GraphLogSum.apply(x, lengths, graph)


class CtcCrfLoss(torch.nn.Module):
    """Per-utterance CTC-CRF losses of a batch (see the module docstring).

    Args:
        graph: the denominator graph (`cat.graph.denominator.load_den_graph`).
        lamb: weight of the CTC loss added to the CRF loss (CAT's `lamb`).
    """

    def __init__(self, graph: DenGraph, lamb: float) -> None:
        super().__init__()
        self.graph = graph
        self.lamb = float(lamb)
        self._den: dict[tuple, Arcs | DenMatrix] = {}

    def den_graph(self, device: torch.device, dtype: torch.dtype) -> Arcs | DenMatrix:
        """The denominator on `device` (built once per device and dtype): a `DenMatrix`,
        or with DENOMINATOR = "arcs" the log-semiring arc engine (exact and slow; for
        tests and bench/crf_loss.py)."""
        key = (str(device), dtype, DENOMINATOR)
        if key not in self._den:
            self._den[key] = (Arcs.shared(self.graph.den, device, dtype)
                              if DENOMINATOR == "arcs"
                              else DenMatrix(self.graph.den, device, dtype))
        return self._den[key]

    def lm_log_probs(self, labels: torch.Tensor, label_lens: torch.Tensor) -> torch.Tensor:
        # The token LM scores on the host: labels and lengths read in one copy.
        rows = torch.cat([label_lens[:, None].to(labels.dtype), labels], dim=1).tolist()
        return torch.tensor([self.graph.lm_log_prob(row[1:1 + row[0]]) for row in rows],
                            dtype=torch.float64)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(losses [B], infeasible [B] bool) for log-potentials x [B, T, V] (fp32 or fp64)."""
        if x.size(-1) != self.graph.num_classes:
            raise ValueError(f"the network has {x.size(-1)} outputs, the denominator graph "
                             f"{self.graph.num_classes} classes")
        lengths = lengths.to(x.device)
        labels, label_lens = labels.to(x.device), label_lens.to(x.device)
        num = graph_log_sum(x, lengths, ctc_graphs(labels, label_lens, x.dtype))
        den = graph_log_sum(x, lengths, self.den_graph(x.device, x.dtype))
        lm = self.lm_log_probs(labels, label_lens).to(device=x.device, dtype=x.dtype,
                                                      non_blocking=True)
        # A transcript the token LM cannot produce (an n-gram the training text lacks, in
        # a dev set under the chain estimator) is scored without its LM term, a constant
        # per utterance: the loss still ranks checkpoints.
        lm = torch.where(torch.isfinite(lm), lm, torch.zeros_like(lm))
        infeasible = ~(torch.isfinite(num) & torch.isfinite(den))
        losses = den - (1.0 + self.lamb) * num - lm
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return torch.where(infeasible, zero, losses), infeasible
