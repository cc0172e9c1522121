"""WFST decoding graphs: TLG = CTC topology o lexicon o word n-gram, and decoding with it.

Symbols (all integer, 0 = epsilon):

* units (`T`'s output, `L`'s input): the tokenizer's ids 1 .. V-1 (phones of a lexicon
  tokenizer, characters of a char tokenizer); the blank 0 never leaves `T`;
* `T`'s input: unit id + 1 (blank = 1), as kaldi-decoder's `DecodableCtc` reads column
  `label - 1` of the log-posteriors;
* words (`L`'s output, `G`): 1 .. N in the order of `words`, then `#0`, `<s>`, `</s>`;
* disambiguation symbols: `#k` on the unit side is V + k (`T` input V + 1 + k); `#0` is
  `G`'s back-off symbol, passed through `L` and `T` by self-loops. Pronunciations that
  are identical or a prefix of another get `#1`, `#2`, ... (Kaldi's rule), so that `L o G`
  determinizes. The disambiguation symbols become epsilons in the finished graph.

A word may have several spellings (a lexicon word's alternative pronunciations,
`cat.text.lexicon`): each is a path of `L` with the word's symbol.

`LG = minimize(determinize_star(L o G))`, `TLG = T o LG` (OpenFST through kaldifst,
tropical semiring; `G` from the ARPA file by kaldilm). kaldilm aborts the whole process
on a malformed ARPA file (and silently skips some bad n-grams), so the file is first
read by the toolkit's own reader (`cat.lm.ngram.iter_arpa`), which raises an ArpaError
naming the file, the line and what is wrong; `<eps>` and `#0` cannot be words. Decoding
runs kaldi-decoder's `FasterDecoder` on the log-posteriors times
`acoustic_scale / lm_weight`.

Usage::

    graph = build_tlg(lambda word: spellings[word], vocab_size, "exp/lm-word-3gram/lm.arpa")
    words = decode(graph, log_probs, acoustic_scale=1.0, lm_weight=1.0, beam=16)
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cat.core.io import PathLike
from cat.lm.ngram import BOS, EOS, ArpaError, iter_arpa, read_arpa, write_arpa_tables


class GraphError(ValueError):
    """A file of a TLG graph dir is unreadable, damaged or not of the graph; the message
    names it (`cat.decoding.wfst.read_graph`)."""


@dataclasses.dataclass
class DecodingGraph:
    """A TLG and its word list (`words[i - 1]` is word symbol i)."""

    fst: object
    words: list[str]
    info: dict


def _disambiguated(prons: Sequence[tuple[int, Sequence[int]]]) -> tuple[list, int]:
    """(word, units, disambiguation index or 0) and the largest index used."""
    by_units: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for word, units in prons:
        by_units[tuple(units)].append(word)
    prefixes = {units[:i] for units in by_units for i in range(1, len(units))}
    out, most = [], 0
    for units, words in by_units.items():
        need = len(words) > 1 or units in prefixes
        for k, word in enumerate(words, 1):
            out.append((word, list(units), k if need else 0))
            most = max(most, k if need else 0)
    return out, most


def _compile(lines: list[str]):
    import kaldifst

    return kaldifst.compile("\n".join(lines) + "\n", acceptor=False)


def ctc_topology(vocab_size: int, disambig: int):
    """T: CTC topology (blank 0) with `disambig` + 1 pass-through disambiguation symbols."""
    import kaldifst

    lines = ["0 0 1 0"]
    for k in range(1, vocab_size):
        lines += [f"0 {k} {k + 1} {k}", f"{k} {k} {k + 1} 0", f"{k} 0 1 0"]
        lines += [f"{k} {j} {j + 1} {j}" for j in range(1, vocab_size) if j != k]
    lines += [str(s) for s in range(vocab_size)]
    fst = _compile(lines)
    kaldifst.add_self_loops(fst, isyms=[vocab_size + 1 + k for k in range(disambig + 1)],
                            osyms=[vocab_size + k for k in range(disambig + 1)])
    return fst


def lexicon_fst(prons: list, vocab_size: int, word_hash0: int):
    """L with disambiguation symbols and the `#0` self-loop."""
    lines, state = [f"0 0 {vocab_size} {word_hash0}"], 0
    for word, units, k in prons:
        symbols = units + ([vocab_size + k] if k else [])
        src = 0
        for i, unit in enumerate(symbols):
            last = i == len(symbols) - 1
            if last:
                dst = 0
            else:
                state += 1
                dst = state
            lines.append(f"{src} {dst} {unit} {word if i == 0 else 0}")
            src = dst
    lines.append("0")
    return _compile(lines)


#: Symbols of the graph's word table that a word of the LM cannot be.
RESERVED_WORDS = {"<eps>": "the epsilon", "#0": "the back-off disambiguation symbol"}


def arpa_words(arpa: PathLike) -> list[str]:
    """The words of an ARPA file's unigrams, without `<s>` and `</s>`, after checking the
    whole file (`cat.lm.ngram.iter_arpa`: an ArpaError names the file and line) so that
    kaldilm, which aborts the process on a malformed file, never reads a bad one."""
    words = []
    for entry in iter_arpa(arpa):
        if len(entry.words) > 1:
            continue
        word = entry.words[0]
        if word in RESERVED_WORDS:
            raise ArpaError(f"{arpa}:{entry.line}: word {word!r} is reserved in decoding "
                            f"graphs ({RESERVED_WORDS[word]})")
        if word not in (BOS, EOS):
            words.append(word)
    return words


def _spellings(pronounce: Callable[[str], Sequence[Sequence[int]] | None],
               words: Sequence[str]) -> tuple[list[tuple[int, list[int]]], int]:
    """(word symbol, units) of every distinct spelling, and the words without one."""
    prons, unpronounced = [], 0
    for i, word in enumerate(words, 1):
        spellings = dict.fromkeys(tuple(units) for units in pronounce(word) or () if units)
        if not spellings:
            unpronounced += 1
        prons.extend((i, list(units)) for units in spellings)
    return prons, unpronounced


def add_unigrams(arpa: PathLike, words: Sequence[str], out: PathLike) -> list[str]:
    """Write `arpa` to `out` with those of `words` it lacks added as unigrams at the
    probability of its least likely unigram; returns the words added."""
    tables = read_arpa(arpa)
    known = {gram[0] for gram in tables[0]}
    floor = min(prob for gram, (prob, _) in tables[0].items() if gram[0] != BOS)
    added = [word for word in dict.fromkeys(words) if word not in known]
    for word in added:
        if word in RESERVED_WORDS or not word or any(c.isspace() for c in word):
            raise ValueError(f"hotword {word!r} cannot be a word of the decoding graph")
        tables[0][(word,)] = (floor, 0.0)
    write_arpa_tables(tables, out)
    return added


def _boost_g(g_text: str, bonus_of_symbol: Mapping[int, float]) -> str:
    """G (OpenFST text, costs) with each arc that outputs a boosted word `bonus` cheaper:
    every n-gram ending with the word."""
    lines = []
    for line in g_text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and int(fields[3]) in bonus_of_symbol:
            cost = float(fields[4]) if len(fields) > 4 else 0.0
            fields = [*fields[:4], f"{cost - bonus_of_symbol[int(fields[3])]:.7g}"]
        lines.append(" ".join(fields))
    return "\n".join(lines) + "\n"


def build_tlg(pronounce: Callable[[str], Sequence[Sequence[int]] | None], vocab_size: int,
              arpa: PathLike, hotwords: Mapping[str, float] | None = None) -> DecodingGraph:
    """TLG of the ARPA word LM `arpa` (checked first: an ArpaError names the file and
    line), each word spelt in units by `pronounce`: every spelling it returns is a path of
    L (a lexicon word's alternative pronunciations); None or none: the word is left out
    of L, counted in `info["unpronounced"]`.

    `hotwords` ({word: bonus}, natural log): contextual biasing in the graph. A hotword
    the LM lacks becomes a unigram at its least likely unigram's probability
    (`add_unigrams`), then every arc of G that outputs a hotword (every n-gram ending with
    it) costs its bonus less. In TLG a hotword is a word, so its bonus counts only when the
    whole phrase is decoded: a partial match earns nothing. `info["hotwords"]`: how many
    the LM had (`boosted`) and how many were added (`added`)."""
    if hotwords:
        with tempfile.TemporaryDirectory() as tmp:
            extended = Path(tmp) / "lm.arpa"
            added = add_unigrams(arpa, list(hotwords), extended)
            graph = _build_tlg(pronounce, vocab_size, extended, hotwords)
        graph.info["hotwords"] = {"boosted": len(hotwords) - len(added), "added": len(added)}
        return graph
    return _build_tlg(pronounce, vocab_size, arpa, {})


def _build_tlg(pronounce: Callable[[str], Sequence[Sequence[int]] | None], vocab_size: int,
               arpa: PathLike, hotwords: Mapping[str, float]) -> DecodingGraph:
    words = arpa_words(arpa)
    prons, unpronounced = _spellings(pronounce, words)
    import kaldifst
    import kaldilm

    num = len(words)
    hash0, bos, eos = num + 1, num + 2, num + 3
    prons_d, most = _disambiguated(prons)
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "words.txt")
        with open(table, "w", encoding="utf-8") as f:
            f.write("<eps> 0\n" + "".join(f"{w} {i}\n" for i, w in enumerate(words, 1)))
            f.write(f"#0 {hash0}\n<s> {bos}\n</s> {eos}\n")
        g_text = kaldilm.arpa2fst(str(arpa), "", disambig_symbol="#0",
                                  read_symbol_table=table, max_arpa_warnings=0)
    if hotwords:
        symbol = {word: index for index, word in enumerate(words, 1)}
        g_text = _boost_g(g_text, {symbol[word]: bonus for word, bonus in hotwords.items()})
    g = kaldifst.compile(g_text, acceptor=False)
    lexicon = lexicon_fst(prons_d, vocab_size, hash0)
    kaldifst.arcsort(lexicon, sort_type="olabel")
    kaldifst.arcsort(g, sort_type="ilabel")
    lg = kaldifst.compose(lexicon, g)
    kaldifst.determinize_star(lg)
    kaldifst.minimize_encoded(lg)
    kaldifst.arcsort(lg, sort_type="ilabel")
    topo = ctc_topology(vocab_size, most)
    kaldifst.arcsort(topo, sort_type="olabel")
    tlg = kaldifst.compose(topo, lg)
    # Disambiguation symbols (input labels above the units) become epsilons.
    lines = []
    for line in tlg.to_str(show_weight_one=False).splitlines():
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) >= 4 and int(fields[2]) > vocab_size:
            fields[2] = "0"
        lines.append(" ".join(fields))
    tlg = _compile(lines)
    kaldifst.connect(tlg)
    kaldifst.arcsort(tlg, sort_type="ilabel")
    info = {"words": num, "unpronounced": unpronounced, "pronunciations": len(prons_d),
            "disambig": most,
            "G_states": g.num_states, "LG_states": lg.num_states,
            "TLG_states": tlg.num_states,
            "TLG_arcs": sum(tlg.num_arcs(s) for s in range(tlg.num_states))}
    return DecodingGraph(tlg, words, info)


class ChunkDecoder:
    """TLG decoding of one utterance's log-posteriors as they arrive, chunk by chunk:
    kaldi-decoder's `FasterDecoder` advances frame by frame over each chunk (`accept`),
    `words()` is the best path so far (partial: it may still change), `words(final=True)`
    the result, the same as `decode` of the whole utterance."""

    def __init__(self, graph: DecodingGraph, acoustic_scale: float = 1.0,
                 lm_weight: float = 1.0, beam: float = 16.0, max_active: int = 7000) -> None:
        from kaldi_decoder import FasterDecoder, FasterDecoderOptions

        self.graph = graph
        self.scale = acoustic_scale / lm_weight
        self.decoder = FasterDecoder(graph.fst, FasterDecoderOptions(beam=beam,
                                                                     max_active=max_active))
        self.decoder.init_decoding()
        self.frames = 0
        self._decodable: Any = None

    def accept(self, log_probs: np.ndarray) -> None:
        """Decode the next frames' log-posteriors [t, V]."""
        from kaldi_decoder import DecodableCtc

        if len(log_probs) == 0:
            return
        scaled = np.ascontiguousarray(log_probs * self.scale, dtype=np.float32)
        # Frame numbers go on from the earlier chunks (the decodable's offset); the decoder
        # reads it while advancing, so it is kept until the next chunk.
        self._decodable = DecodableCtc(scaled, self.frames)
        self.decoder.advance_decoding(self._decodable)
        self.frames += len(scaled)

    def words(self, final: bool = False) -> list[str]:
        """Words of the best path so far; `final`: of the best path ending in a final state
        (empty when none does, or before any frame)."""
        return self.best(final)[0]

    def best(self, final: bool = False) -> tuple[list[str], list[int]]:
        """(words, units) of the best path so far (`final` as in `words`): the units are
        the tokenizer's ids the path reads, its frames' CTC labels with repeats and blanks
        removed (the CTC topology puts a blank between two equal units)."""
        import kaldifst

        if self.frames == 0 or (final and not self.decoder.reached_final()):
            return [], []
        ok, best = self.decoder.get_best_path(final)
        if not ok:
            return [], []
        ok, ilabels, olabels, _ = kaldifst.get_linear_symbol_sequence(best)
        if not ok:
            return [], []
        num = len(self.graph.words)
        units, previous = [], 0
        for label in ilabels:  # T's input: unit + 1, blank 1
            unit = label - 1
            if unit > 0 and unit != previous:
                units.append(unit)
            previous = unit
        return [self.graph.words[o - 1] for o in olabels if 0 < o <= num], units


def decode(graph: DecodingGraph, log_probs: np.ndarray, acoustic_scale: float = 1.0,
           lm_weight: float = 1.0, beam: float = 16.0, max_active: int = 7000) -> list[str]:
    """Best word sequence of one utterance's log-posteriors [T, V] (empty when no path)."""
    return decode_path(graph, log_probs, acoustic_scale, lm_weight, beam, max_active)[0]


def decode_path(graph: DecodingGraph, log_probs: np.ndarray, acoustic_scale: float = 1.0,
                lm_weight: float = 1.0, beam: float = 16.0, max_active: int = 7000
                ) -> tuple[list[str], list[int]]:
    """(words, units) of the best path of one utterance's log-posteriors (`ChunkDecoder.best`)."""
    decoder = ChunkDecoder(graph, acoustic_scale, lm_weight, beam, max_active)
    decoder.accept(log_probs)
    return decoder.best(final=True)
