"""WFST decoding of CTC and CTC-CRF models with TLG (CAT's `fst_decode.sh` without Kaldi).

A word n-gram (an LM experiment of stage 5, e.g. `exp/lm-word-3gram`) and the
experiment's tokenizer give TLG (`cat.graph.tlg`): each word of the LM is spelt in the
tokenizer's units, phones through the lexicon tokenizer's rules (`cat.text.lexicon`:
every pronunciation of a lexicon entry, else the longest lexicon words inside it) or
characters of a char tokenizer; a word with a unit the tokenizer does not have (`<unk>`)
is left out of L and counted. The model's log-posteriors (the network's log-softmax, for
CTC-CRF as for CTC) are decoded by kaldi-decoder's FasterDecoder with
`acoustic_scale / lm_weight`.
Stage 5 runs it for `inference.lm.settings.<name>.wfst` (`cat.stages.lm`).

`inference.infer.option.tlg` (`python -m cat.decode --tlg DIR --lm-weight W`) decodes a
feature dir or audio with a graph stage 5 built (`TlgSearcher`, what
`cat.decoding.searcher.searcher_for` gives with it, importing this module only then): the
words of the best path, each timed by its units' spikes on the forced alignment of the
path's units to the log-posteriors (the definition of the other searches' times,
`cat.decoding.timestamps`), so `--format json | ctm | srt` hold word times.

Hotwords (`inference.infer.option.hotwords`, the file the beam searches read) bias the
graph itself: each phrase is a word of G whose n-grams gain its bonus (its score per token
times its tokens), a new unigram when the LM lacks it (`hotword_boosts`,
`cat.graph.tlg.build_tlg`). Its bonus counts only when the whole phrase is decoded, as
the context graph's does in the beam searches.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kaldiio
import numpy as np
import torch

from cat.core.config import CONFIG_NAME, experiment_kind
from cat.core.io import PathLike, atomic_write
from cat.decoding.context_graph import read_hotword_phrases
from cat.decoding.results import Result
from cat.decoding.searcher import NO_LABEL, DecodeOptions, FusionSpec, Searcher, plan_batches
from cat.decoding.timestamps import FRAME_SHIFT_SECONDS, TimedUnit, token_times
from cat.formats.tables import read_feature_index
from cat.graph.tlg import (
    ChunkDecoder,
    DecodingGraph,
    GraphError,
    build_tlg,
    decode,
    decode_path,
)
from cat.loading.batch import Utterance, collate
from cat.text.lexicon import LexiconTokenizer
from cat.text.tokenizer import UNK_ID, Tokenizer

logger = logging.getLogger(__name__)


def pronouncer(tokenizer: Tokenizer) -> Callable[[str], list[list[int]] | None]:
    """Unit spellings of a word: every pronunciation of a lexicon word (those with a part
    without one left out), the tokenizer's encoding otherwise; None when it has none."""
    def spell(word: str) -> list[list[int]] | None:
        if isinstance(tokenizer, LexiconTokenizer):
            spellings = [[tokenizer.unit_to_id[p] for p in phones]
                         for phones in tokenizer.pronunciations(word)]
        else:
            spellings = [tokenizer.encode(word)]
        return [ids for ids in spellings if ids and UNK_ID not in ids] or None
    return spell


def hotword_boosts(path: PathLike, tokenizer: Tokenizer, default_score: float
                   ) -> dict[str, float]:
    """{word: bonus} of a hotwords file for TLG (`cat.graph.tlg.build_tlg`): each phrase,
    written without spaces as the graph's (Chinese) words are, gains its score per token
    times its tokens, as in the beam searches (`cat.decoding.context_graph`)."""
    phrases, _ = read_hotword_phrases(path, tokenizer, default_score)
    boosts: dict[str, float] = {}
    for text, tokens, score in phrases:
        word = "".join(text.split())
        boosts[word] = max(boosts.get(word, -math.inf), score * len(tokens))
    return boosts


def decoding_graph(tokenizer: Tokenizer, arpa: PathLike, out_dir: PathLike,
                   hotwords: dict[str, float] | None = None) -> DecodingGraph:
    """TLG of `arpa` for `tokenizer` (with `hotwords`, {word: bonus}, boosted:
    `hotword_boosts`), cached in `out_dir` (TLG.fst, words.json; a cache built for other
    hotwords is built again)."""
    out_dir = Path(out_dir)
    fst_path, words_path = out_dir / "TLG.fst", out_dir / "words.json"
    if fst_path.is_file() and words_path.is_file():
        try:
            graph = read_graph(out_dir)
        except GraphError as error:
            logger.warning("%s; building it again", error)
        else:
            if graph.info.get("hotword_boosts", {}) == (hotwords or {}):
                return graph
    graph = build_tlg(pronouncer(tokenizer), tokenizer.vocab_size, arpa, hotwords)
    if hotwords:
        graph.info["hotword_boosts"] = dict(hotwords)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".TLG.fst.tmp"
    graph.fst.write(str(tmp))
    tmp.replace(fst_path)
    graph.info["TLG_bytes"] = fst_path.stat().st_size
    with atomic_write(words_path) as f:
        json.dump({"words": graph.words, "info": graph.info}, f, ensure_ascii=False)
    logger.info("TLG %s: %s", fst_path, graph.info)
    return graph


_REBUILD = "build the graph again (stage 5 rebuilds a graph dir it finds damaged)"


def read_graph(graph_dir: PathLike) -> DecodingGraph:
    """The TLG `decoding_graph` cached in `graph_dir` (TLG.fst, words.json), each file
    checked: `FileNotFoundError` for a missing one, `GraphError` naming the file for a
    `words.json` that is not the graph's word list, a `TLG.fst` of another size than the
    one `words.json` records (damaged, or of another build), or one OpenFST cannot read."""
    import kaldifst

    graph_dir = Path(graph_dir)
    fst_path, words_path = graph_dir / "TLG.fst", graph_dir / "words.json"
    for path in (fst_path, words_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (a TLG graph dir holds TLG.fst and "
                                    "words.json: stage 5 builds them)")
    words, info = _read_words(words_path)
    recorded, size = info.get("TLG_bytes"), fst_path.stat().st_size
    if recorded is not None and recorded != size:
        raise GraphError(f"{fst_path}: {size} bytes, but {words_path} records {recorded}: "
                         f"damaged, or written by another build than its words; {_REBUILD}")
    fst = kaldifst.StdVectorFst.read(str(fst_path))
    if fst is None:  # OpenFST has logged why
        raise GraphError(f"{fst_path}: not a readable OpenFST graph (damaged or truncated); "
                         f"{_REBUILD}")
    return DecodingGraph(fst, words, info)


def _read_words(path: Path) -> tuple[list[str], dict]:
    """(words, info) of a graph's `words.json`; `GraphError` naming it and what is wrong."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise GraphError(f"{path}: not a TLG words file: not UTF-8 ({error.reason} at byte "
                         f"{error.start}); {_REBUILD}") from None
    except json.JSONDecodeError as error:
        raise GraphError(f"{path}: not a TLG words file: invalid JSON at line {error.lineno} "
                         f"column {error.colno}: {error.msg}; {_REBUILD}") from None
    words = meta.get("words") if isinstance(meta, dict) else None
    info = meta.get("info") if isinstance(meta, dict) else None
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words) \
            or not isinstance(info, dict):
        raise GraphError(f"{path}: not a TLG words file: expected an object with 'words' (a "
                         f"list of strings) and 'info' (an object); {_REBUILD}")
    return words, info


def check_frame_posteriors(model: Any) -> None:
    """ValueError unless `model`'s first head gives frame posteriors (what TLG decodes)."""
    if not model.frame_posteriors:
        raise ValueError("WFST decoding needs the frame posteriors of a CTC or CTC-CRF "
                         "head; this model's first head gives none")


class TlgChunkSearch:
    """Streaming WFST decoding: each chunk's log-posteriors of the model's first head (CTC
    or CTC-CRF) through TLG (`cat.graph.tlg.ChunkDecoder`). `tokens` are the words of the
    best path so far, and after `finish` those of WFST decoding of the whole utterance;
    `text` joins them without spaces (Chinese), as `decode_all` does."""

    def __init__(self, model: Any, graph: DecodingGraph, acoustic_scale: float = 1.0,
                 lm_weight: float = 1.0, beam: float = 16.0) -> None:
        check_frame_posteriors(model)
        self.head = model.first_head
        self.decoder = ChunkDecoder(graph, acoustic_scale, lm_weight, beam)
        self.tokens: list[str] = []

    def step(self, encoder_out: torch.Tensor) -> None:
        """Decode one chunk's encoder output [T', D]."""
        self.decoder.accept(self.head.log_probs(encoder_out[None])[0].numpy())
        self.tokens = self.decoder.words()

    def finish(self) -> None:
        self.tokens = self.decoder.words(final=True)

    def text(self, tokenizer: Any) -> str:
        return "".join(self.tokens)


def log_posteriors(exp_dir: PathLike, checkpoint: PathLike, data_dir: PathLike,
                   options: DecodeOptions,
                   batches: list[list[str]] | None = None) -> dict[str, np.ndarray]:
    """{utterance: log-posteriors [T', V]} of a feature dir (CPU, one process): of the
    utterances of `batches` (a share of a stage-5 array task), by default of every one in
    `plan_batches`'s batches. An utterance's posteriors depend on its batch (padding), so
    a share is cut from those batches to give the figures of the whole set."""
    # Posteriors do not depend on hotwords: WFST decoding boosts them in the graph.
    options = dataclasses.replace(options, hotwords=None)
    searcher = Searcher(exp_dir, checkpoint, options, "cpu")
    if not searcher.model.frame_posteriors:
        raise ValueError(f"{Path(exp_dir) / CONFIG_NAME}: WFST decoding needs frame posteriors "
                         f"of a CTC head, which a {experiment_kind(exp_dir)} model has not")
    if batches is None:
        table = read_feature_index(Path(data_dir) / "feats.scp")
        lengths = dict(zip(table.keys, table.num_frames.tolist(), strict=True))
        batches = plan_batches(lengths, options.max_frames, options.batch_size)
    features = kaldiio.load_scp(str(Path(data_dir) / "feats.scp"))
    out: dict[str, np.ndarray] = {}
    for keys in batches:
        batch = collate([Utterance(k, features[k], NO_LABEL) for k in keys])
        with torch.inference_mode():
            log_probs, lens = searcher.model.log_probs(batch.feats, batch.feat_lens)
        for i, key in enumerate(keys):
            out[key] = log_probs[i, :int(lens[i])].numpy()
    return out


def decode_all(graph: DecodingGraph, posteriors: dict[str, np.ndarray], acoustic_scale: float,
               lm_weight: float, beam: float) -> dict[str, str]:
    """{utterance: words joined without spaces (Chinese)}."""
    return {key: "".join(decode(graph, lp, acoustic_scale, lm_weight, beam))
            for key, lp in posteriors.items()}


def word_spans(words: list[str], units: list[int],
               spell: Callable[[str], list[list[int]] | None]) -> list[tuple[int, int]]:
    """Each word's first and last index in `units`, the units a TLG path reads for `words`
    (its spellings, one after the other); ValueError when they do not spell them."""
    spans: list[tuple[int, int]] = []

    def place(word_index: int, start: int) -> bool:
        if word_index == len(words):
            return start == len(units)
        for spelling in spell(words[word_index]) or []:
            end = start + len(spelling)
            if units[start:end] == spelling:
                spans.append((start, end - 1))
                if place(word_index + 1, end):
                    return True
                spans.pop()
        return False

    if not place(0, 0):
        raise ValueError(f"the units {units} do not spell the words {words}")
    return spans


class TlgSearcher(Searcher):
    """A `Searcher` decoding with TLG (`DecodeOptions.tlg`, a graph directory of stage 5):
    `best` gives the words of the best path joined without spaces (Chinese), `results`
    the words with their times (see the module docstring); no N-best lists."""

    def __init__(self, exp_dir: PathLike, checkpoint: PathLike,
                 options: DecodeOptions, device: str,
                 specs: list[FusionSpec | None] | tuple = ()) -> None:
        if any(spec is not None for spec in specs):
            raise ValueError("tlg: the word LM is in the graph; shallow fusion (--lm) "
                             "goes with the model's beam search")
        super().__init__(exp_dir, checkpoint, options, device)
        check_frame_posteriors(self.model)
        self.graph = read_graph(options.tlg)
        self.spell = pronouncer(self.tokenizer)

    def _paths(self, utterances: list[Utterance]
               ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[str], list[int]]]]:
        """The encoder output and lengths of a batch (what the first head aligns), and the
        best path of each utterance's log-posteriors (`model.log_probs`' values)."""
        batch = collate(utterances)
        with torch.inference_mode():
            hidden, lengths = self.model.encode(batch.feats.to(self.device),
                                                batch.feat_lens.to(self.device))
            log_probs = self.model.first_head.log_probs(hidden).cpu()
        paths = [decode_path(self.graph, log_probs[i, :int(lengths[i])].numpy(),
                             lm_weight=self.options.lm_weight, beam=self.options.wfst_beam)
                 for i in range(len(utterances))]
        return hidden, lengths, paths

    def best(self, utterances: list[Utterance]) -> list[tuple[str, str]]:
        _, _, paths = self._paths(utterances)
        return [(u.key, "".join(words)) for u, (words, _) in zip(utterances, paths,
                                                                   strict=True)]

    def results(self, utterances: list[Utterance], timestamps: bool = True) -> list[Result]:
        hidden, lengths, paths = self._paths(utterances)
        spans: list[Any] = [None] * len(paths)
        if timestamps:
            with torch.inference_mode():
                # The units' spikes on the forced alignment, as the head aligns its searches'.
                spans = self.model.first_head.token_frames(hidden, lengths,
                                                           [units for _, units in paths])
        factor = int(self.model.encoder.frame_rate_factor)
        results = []
        for index, (utterance, (words, units)) in enumerate(zip(utterances, paths,
                                                                 strict=True)):
            times = None
            if spans[index] is not None:
                duration = len(utterance.features) * FRAME_SHIFT_SECONDS
                tokens = token_times(spans[index], factor, None, duration)
                times = tuple(TimedUnit(word, tokens[first].start, tokens[last].end,
                                        min(t.confidence for t in tokens[first:last + 1]))
                              for word, (first, last) in zip(
                                  words, word_spans(words, units, self.spell), strict=True))
            results.append(Result(utterance.key, "".join(words), tuple(words), times, None,
                                  tuple(units)))
        return results

    def nbest(self, utterances: list[Utterance]) -> list[list[tuple[str, Any]]]:
        raise ValueError("tlg: WFST decoding gives the best path only, no N-best lists")
