"""The CTC-CRF loss against brute-force enumeration of every frame path on tiny graphs."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from cat.crf.loss import CtcCrfLoss, ctc_graphs, graph_log_sum
from cat.graph.denominator import build_den_graph
from cat.lm.ngram import EOS, UNK, estimate

CORPUS = [[1, 2, 3], [2, 3], [3, 1, 2, 2], [1, 1], [2, 1, 3, 3, 1], [3, 2]]


def reference_lm(sentences, order):
    """p(y) of the ARPA model by its back-off rule, conditioned on never emitting <unk>:
    a separate implementation over `NGramModel.entries`, with full histories."""
    model = estimate([[str(t) for t in s] for s in sentences], order,
                     discount_fallback=(0.5, 1.0, 1.5))
    table = {}
    for n in range(1, order + 1):
        table.update(model.entries(n))

    def cond(history, word):
        history = tuple(history[-(order - 1):]) if order > 1 else ()
        total = 0.0
        while (*history, word) not in table:
            total += table.get(history, (0.0, 0.0))[1]
            history = history[1:]
        return (total + table[(*history, word)][0]) * math.log(10.0)

    def log_prob(tokens):
        words = [str(t) for t in tokens]
        if any((w,) not in table for w in words):
            return -math.inf
        history, total = ["<s>"], 0.0
        for w in [*words, EOS]:
            total += cond(history, w) - math.log1p(-math.exp(cond(history, UNK)))
            history.append(w)
        return total
    return log_prob


def collapse(path):
    out, prev = [], 0
    for p in path:
        if p != prev and p != 0:
            out.append(p)
        prev = p
    return tuple(out)


def brute_force(x, length, labels, lm_log_prob, lamb):
    """-log p(labels | x) + lamb * CTC by enumerating all V^T frame paths (autograd)."""
    frames, classes = length, x.size(-1)
    paths = torch.tensor(list(itertools.product(range(classes), repeat=frames)))
    scores = x[torch.arange(frames), paths].sum(1)
    strings = [collapse(p) for p in paths.tolist()]
    cache = {s: lm_log_prob(s) for s in set(strings)}
    lm = torch.tensor([cache[s] for s in strings], dtype=x.dtype)
    den = torch.logsumexp(scores + lm, 0)
    mine = torch.tensor([s == tuple(labels) for s in strings])
    num = torch.logsumexp(scores[mine], 0)
    return den - num - cache[tuple(labels)] - lamb * num


@pytest.mark.parametrize(("order", "classes", "lamb"), [(1, 4, 0.01), (2, 4, 0.0),
                                                        (3, 4, 0.5), (2, 5, 0.01)])
def test_loss_and_gradient_equal_brute_force(order, classes, lamb):
    # classes 5: token 4 never occurs in the transcripts, so the LM gives it no arcs.
    graph = build_den_graph(CORPUS, classes, order=order, estimator="kneser-ney")
    reference = reference_lm(CORPUS, order)
    torch.manual_seed(order * 10 + classes)
    lengths = torch.tensor([5, 4, 3])
    labels = torch.tensor([[1, 2, 2], [3, 1, 0], [2, 0, 0]])
    label_lens = torch.tensor([3, 2, 1])
    x = torch.log_softmax(torch.randn(3, 5, classes, dtype=torch.float64), -1)
    x.requires_grad_(True)
    losses, infeasible = CtcCrfLoss(graph, lamb)(x, lengths, labels, label_lens)
    assert not infeasible.any()
    weights = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    (grad,) = torch.autograd.grad((losses * weights).sum(), x)
    for b in range(3):
        xb = x.detach()[b, :lengths[b]].clone().requires_grad_(True)
        expected = brute_force(xb, int(lengths[b]), labels[b, :label_lens[b]].tolist(),
                               reference, lamb)
        (expected_grad,) = torch.autograd.grad(expected * weights[b], xb)
        assert abs(float(losses[b].detach()) - float(expected.detach())) < 1e-5
        assert torch.allclose(grad[b, :lengths[b]], expected_grad, atol=1e-5, rtol=0)
        assert torch.all(grad[b, lengths[b]:] == 0)


def test_lm_acceptor_gives_each_string_its_normalised_probability():
    # The trap of epsilon back-off arcs: a string reached by an n-gram arc and by a
    # back-off path would be counted twice. The acceptor's path weight of every string
    # equals the model's probability, and the total mass is 1.
    graph = build_den_graph(CORPUS, 4, order=3, estimator="kneser-ney")
    reference = reference_lm(CORPUS, 3)
    for n in range(4):
        for tokens in itertools.product(range(1, 4), repeat=n):
            assert abs(graph.lm_log_prob(tokens) - reference(tokens)) < 1e-9
    lm = graph.lm
    arcs = np.zeros((lm.num_states, lm.num_states))
    np.add.at(arcs, (lm.src, lm.dst), np.exp(lm.weight))
    total = np.linalg.solve(np.eye(lm.num_states) - arcs, np.exp(lm.final))[lm.start]
    assert abs(total - 1.0) < 1e-9


def test_infeasible_utterances_get_zero_loss_and_no_gradient():
    graph = build_den_graph(CORPUS, 5, order=2, estimator="kneser-ney")
    x = torch.log_softmax(torch.randn(2, 3, 5, dtype=torch.float64), -1).requires_grad_(True)
    labels = torch.tensor([[1, 1, 2], [4, 0, 0]])  # 1 1 2 needs 4 frames
    losses, infeasible = CtcCrfLoss(graph, 0.01)(x, torch.tensor([3, 3]), labels,
                                          torch.tensor([3, 1]))
    assert infeasible.tolist() == [True, False]
    losses[0].backward()
    assert losses[0] == 0 and torch.all(x.grad == 0)


@pytest.mark.parametrize("estimator", ["chain", "kneser-ney"])
def test_a_transcript_the_lm_cannot_produce_keeps_its_loss_without_the_lm_term(estimator):
    # Token 4 never occurs in the LM's text: both estimators give it probability 0. Its
    # loss is kept, without the LM term; a transcript the LM holds (2 2) keeps the term.
    graph = build_den_graph(CORPUS, 5, order=2, estimator=estimator)
    torch.manual_seed(5)
    x = torch.log_softmax(torch.randn(2, 6, 5, dtype=torch.float64), -1).requires_grad_(True)
    labels, label_lens = torch.tensor([[4, 0], [2, 2]]), torch.tensor([1, 2])
    lengths = torch.tensor([6, 6])
    assert graph.lm_log_prob([4]) == -math.inf
    lamb = 0.01
    losses, infeasible = CtcCrfLoss(graph, lamb)(x, lengths, labels, label_lens)
    assert not infeasible.any()
    num = graph_log_sum(x, lengths, ctc_graphs(labels, label_lens, x.dtype))
    den = graph_log_sum(x, lengths, CtcCrfLoss(graph, 0.0).den_graph(x.device, x.dtype))
    lm = torch.tensor([0.0, graph.lm_log_prob([2, 2])], dtype=x.dtype)
    assert torch.allclose(losses, den - (1 + lamb) * num - lm)
    (grad,) = torch.autograd.grad(losses[0], x)
    assert grad.abs().sum() > 0


def test_gradcheck():
    graph = build_den_graph(CORPUS, 4, order=2)
    loss = CtcCrfLoss(graph, 0.01)
    x = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    lengths, labels, label_lens = torch.tensor([4, 3]), torch.tensor([[1, 3], [2, 0]]), \
        torch.tensor([2, 1])
    assert torch.autograd.gradcheck(lambda v: loss(v, lengths, labels, label_lens)[0], (x,))


def test_numerator_equals_torch_ctc_loss():
    torch.manual_seed(0)
    x = torch.log_softmax(torch.randn(3, 7, 6), -1)
    labels = torch.tensor([[1, 1, 2], [5, 4, 0], [3, 0, 0]])
    label_lens, lengths = torch.tensor([3, 2, 1]), torch.tensor([7, 5, 6])
    ours = graph_log_sum(x, lengths, ctc_graphs(labels, label_lens, x.dtype))
    theirs = torch.nn.functional.ctc_loss(x.transpose(0, 1), labels, lengths, label_lens,
                                          reduction="none")
    assert torch.allclose(-ours, theirs, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_equals_cpu():
    graph = build_den_graph(CORPUS, 4, order=3)
    loss = CtcCrfLoss(graph, 0.01)
    torch.manual_seed(1)
    x = torch.log_softmax(torch.randn(3, 9, 4), -1)
    lengths, labels = torch.tensor([9, 7, 8]), torch.tensor([[1, 2, 3], [2, 2, 0], [3, 0, 0]])
    label_lens = torch.tensor([3, 2, 1])
    results = []
    for device in ("cpu", "cuda"):
        xd = x.to(device).requires_grad_(True)
        losses, _ = loss(xd, lengths.to(device), labels.to(device), label_lens.to(device))
        (grad,) = torch.autograd.grad(losses.sum(), xd)
        results.append((losses.cpu(), grad.cpu()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-4)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


def test_matrix_denominator_in_float32_matches_the_log_semiring_arcs_in_float64():
    # The shared denominator runs as a transition matrix in the probability semiring with
    # per-frame scales; over 120 frames of peaky posteriors it agrees with the per-arc
    # log-semiring recursion (exact in float64, and equal to it to rounding).
    from cat.crf.loss import (
        Arcs,
        DenMatrix,
        _den_forward,
        _den_occupancies,
        _forward,
        _occupancies,
    )

    graph = build_den_graph(CORPUS * 3, 4, order=3)
    torch.manual_seed(3)
    x = torch.log_softmax(4 * torch.randn(2, 120, 4, dtype=torch.float64), -1)
    lengths = torch.tensor([120, 77])
    exact = Arcs.shared(graph.den, x.device, torch.float64)
    alphas, log_z = _forward(x, lengths, exact)
    grad = _occupancies(x, lengths, exact, alphas, log_z)
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        den = DenMatrix(graph.den, x.device, dtype)
        xd = x.to(dtype)
        alphas_m, log_z_m = _den_forward(xd, lengths, den)
        grad_m = _den_occupancies(xd, lengths, den, alphas_m, log_z_m)
        assert torch.allclose(log_z_m.double(), log_z, rtol=0, atol=10 * tolerance)
        assert torch.allclose(grad_m.double(), grad, rtol=0, atol=tolerance)


def test_matrix_denominator_refuses_a_state_entered_by_two_labels():
    from cat.crf.loss import DenMatrix
    from cat.graph.denominator import Fsa

    two = Fsa(num_states=2, start=0, src=np.array([0, 0]), dst=np.array([1, 1]),
              label=np.array([1, 2]), weight=np.zeros(2), final=np.zeros(2))
    with pytest.raises(ValueError, match="entered by two labels"):
        DenMatrix(two, torch.device("cpu"), torch.float64)


def test_pruned_histories_keep_a_normalised_smaller_graph():
    sentences = CORPUS * 2 + [[1, 3, 2, 1, 1, 3], [2, 2, 3, 1, 2]]
    full = build_den_graph(sentences, 4, order=4)
    pruned = build_den_graph(sentences, 4, order=4, extra_states=2)
    assert pruned.lm.num_states < full.lm.num_states and pruned.info["extra_states"] == 2
    assert pruned.den.num_arcs < full.den.num_arcs
    lm = pruned.lm
    arcs = np.zeros((lm.num_states, lm.num_states))
    np.add.at(arcs, (lm.src, lm.dst), np.exp(lm.weight))
    total = np.linalg.solve(np.eye(lm.num_states) - arcs, np.exp(lm.final))[lm.start]
    assert abs(total - 1.0) < 1e-9


@pytest.mark.parametrize("order", [2, 3])
def test_chain_lm_loss_equals_brute_force(order):
    # The chain LM gives unseen token strings probability 0 (-inf in the sum).
    graph = build_den_graph(CORPUS, 4, order=order, estimator="chain")
    torch.manual_seed(order)
    x = torch.log_softmax(torch.randn(3, 5, 4, dtype=torch.float64), -1).requires_grad_(True)
    lengths, labels = torch.tensor([5, 4, 3]), torch.tensor([[1, 2, 3], [3, 2, 0], [1, 1, 0]])
    label_lens = torch.tensor([3, 2, 2])
    losses, infeasible = CtcCrfLoss(graph, 0.01)(x, lengths, labels, label_lens)
    assert not infeasible.any()
    (grad,) = torch.autograd.grad(losses.sum(), x)
    for b in range(3):
        xb = x.detach()[b, :lengths[b]].clone().requires_grad_(True)
        expected = brute_force(xb, int(lengths[b]), labels[b, :label_lens[b]].tolist(),
                               graph.lm_log_prob, 0.01)
        (expected_grad,) = torch.autograd.grad(expected, xb)
        assert abs(float(losses[b].detach()) - float(expected.detach())) < 1e-5
        assert torch.allclose(grad[b, :lengths[b]], expected_grad, atol=1e-5, rtol=0)
