"""The CTC-CRF loss: batched forward-backward over weighted acceptors in the log semiring.

For log-potentials `x` [B, T, V] (the network's log-softmax output, blank = 0), a label
sequence `y` and the denominator graph `D` = CTC topology o token LM
(`cat.graph.denominator`)::

    log p(y | x) = log sum_{pi in CTC(y)} exp(sum_t x[t, pi_t]) + log P_LM(y)
                   - log sum_{pi in D}    exp(sum_t x[t, pi_t] + LM weight of pi)
    loss         = -log p(y | x) + lamb * CTC(y)           (CAT's `lamb`, 0.01)
                 = -(1 + lamb) * num_ctc - log P_LM(y) + log Z_den

`log P_LM(y)` does not depend on `x`; it is kept so that the loss is the CRF's negative
log-likelihood. Both path sums run on one engine (`GraphLogSum`): the CTC graph of each
label sequence (a padded batch of 2U+1-state graphs) and the shared denominator graph
(one arc list for the whole batch). The backward pass recomputes the backward variables
frame by frame and scatters each arc's occupancy onto the frame's label, so memory stays
at the forward variables, O(frames x states) per utterance, plus one frame of arcs.

Utterances whose label sequence has no path (too few frames, or a token the LM never
emits) get loss 0 and no gradient; `infeasible` reports them.
"""

from __future__ import annotations

import numpy as np
import torch

from cat.graph.denominator import DenGraph, Fsa

NEG_INF = float("-inf")
# The shared (denominator) graph in the probability semiring with per-frame scales; False
# runs it in the log semiring like the CTC graphs (bench/crf_loss.py compares the two).
SCALED_DENOMINATOR = True


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


def _forward_scaled(x: torch.Tensor, lengths: torch.Tensor, arcs: Arcs
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_forward` in the probability semiring with a scale per frame (the graph's forward
    variables divided by their maximum, the log of the scales kept apart): for a graph
    shared by the batch, where it saves the per-arc exp / log of the log semiring.
    Returns (scaled alphas [T+1, B, S], log scales [T+1, B], log Z [B])."""
    batch, frames, _ = x.shape
    src, dst, label, _ = arcs.expanded(batch)
    arc_weight = torch.exp(arcs.weight)
    alphas = x.new_zeros((frames + 1, batch, arcs.num_states))
    alphas[0].scatter_(1, arcs.start.expand(batch)[:, None], 1.0)
    scales = x.new_zeros((frames + 1, batch))
    for t in range(frames):
        peak_x = x[:, t].max(dim=1).values
        emit = torch.exp(x[:, t] - peak_x[:, None])
        mass = alphas[t].gather(1, src) * arc_weight * emit.gather(1, label)
        new = torch.zeros_like(alphas[t]).scatter_add_(1, dst, mass)
        norm = new.max(dim=1).values
        norm = torch.where(norm > 0, norm, torch.ones_like(norm))
        live = t < lengths
        alphas[t + 1] = torch.where(live[:, None], new / norm[:, None], alphas[t])
        scales[t + 1] = torch.where(live, scales[t] + peak_x + torch.log(norm), scales[t])
    with torch.no_grad():
        total = (alphas[frames] * torch.exp(arcs.final)).sum(dim=1)
    log_z = torch.log(total) + scales[frames]
    return alphas, scales, log_z


def _occupancies_scaled(x: torch.Tensor, lengths: torch.Tensor, arcs: Arcs,
                        alphas: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    """`_occupancies` from `_forward_scaled`'s alphas: per frame, each arc's share of
    alpha x arc x beta, normalised over the frame's arcs (their posteriors sum to 1)."""
    batch, frames, _ = x.shape
    src, dst, label, _ = arcs.expanded(batch)
    arc_weight = torch.exp(arcs.weight)
    grad = torch.zeros_like(x)
    final = arcs.final.expand(batch, -1)
    beta = torch.exp(final - final.max(dim=1, keepdim=True).values)
    ok = torch.isfinite(log_z)
    for t in range(frames - 1, -1, -1):
        live = t < lengths
        emit = torch.exp(x[:, t] - x[:, t].max(dim=1, keepdim=True).values)
        ahead = arc_weight * emit.gather(1, label) * beta.gather(1, dst)
        share = alphas[t].gather(1, src) * ahead
        total = share.sum(dim=1, keepdim=True)
        use = (live & ok)[:, None] & (total > 0)
        post = torch.where(use, share / torch.where(total > 0, total, torch.ones_like(total)),
                           torch.zeros_like(share))
        grad[:, t].scatter_add_(1, label, post)
        new = torch.zeros_like(beta).scatter_add_(1, src, ahead)
        norm = new.max(dim=1, keepdim=True).values
        new = new / torch.where(norm > 0, norm, torch.ones_like(norm))
        beta = torch.where(live[:, None], new, beta)
    return grad


class GraphLogSum(torch.autograd.Function):
    """log Z [B] of acceptors over the frames of x (see `_forward`), with an explicit
    backward from forward-backward occupancies."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lengths: torch.Tensor, arcs: Arcs) -> torch.Tensor:
        # A graph shared by the batch (the denominator) is large: probability semiring
        # with per-frame scales; per-utterance CTC graphs stay in the log semiring.
        ctx.scaled = SCALED_DENOMINATOR and arcs.src.size(0) == 1
        if ctx.scaled:
            alphas, _, log_z = _forward_scaled(x.detach(), lengths, arcs)
        else:
            alphas, log_z = _forward(x.detach(), lengths, arcs)
        ctx.save_for_backward(x, lengths, alphas, log_z)
        ctx.arcs = arcs
        return log_z

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, lengths, alphas, log_z = ctx.saved_tensors
        occupancies = _occupancies_scaled if ctx.scaled else _occupancies
        occupancy = occupancies(x.detach(), lengths, ctx.arcs, alphas, log_z)
        return occupancy * grad_out[:, None, None], None, None


def graph_log_sum(x: torch.Tensor, lengths: torch.Tensor, arcs: Arcs) -> torch.Tensor:
    """Differentiable log partition function of `arcs` over x [B, T, V]."""
    return GraphLogSum.apply(x, lengths, arcs)


class CtcCrfLoss(torch.nn.Module):
    """Per-utterance CTC-CRF losses of a batch (see the module docstring).

    Args:
        graph: the denominator graph (`cat.graph.denominator.load_den_graph`).
        lamb: weight of the CTC loss added to the CRF loss (CAT's `lamb`).
    """

    def __init__(self, graph: DenGraph, lamb: float = 0.01) -> None:
        super().__init__()
        self.graph = graph
        self.lamb = float(lamb)
        self._arcs: dict[tuple, Arcs] = {}

    def den_arcs(self, device: torch.device, dtype: torch.dtype) -> Arcs:
        key = (str(device), dtype)
        if key not in self._arcs:
            self._arcs[key] = Arcs.shared(self.graph.den, device, dtype)
        return self._arcs[key]

    def lm_log_probs(self, labels: torch.Tensor, label_lens: torch.Tensor) -> torch.Tensor:
        rows = labels.tolist()
        return torch.tensor([self.graph.lm_log_prob(row[:n])
                             for row, n in zip(rows, label_lens.tolist(), strict=True)],
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
        den = graph_log_sum(x, lengths, self.den_arcs(x.device, x.dtype))
        lm = self.lm_log_probs(labels, label_lens).to(device=x.device, dtype=x.dtype)
        infeasible = ~(torch.isfinite(num) & torch.isfinite(den) & torch.isfinite(lm))
        losses = den - (1.0 + self.lamb) * num - lm
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return torch.where(infeasible, zero, losses), infeasible
