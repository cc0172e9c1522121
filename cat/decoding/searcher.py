"""What every decoding run shares: its options, the model of an experiment, batching by
length, and `Searcher`, one process's model decoding batches of utterances.

`DecodeOptions` come from `hyper-p.json: inference.infer.option` (what stage 4 uses),
overridden by the command line (`DecodeOptions.of_experiment`); besides the search
options there (`options_schema()`), `allow_config_change` accepts a `config.json` changed
since training (`ACCEPT_SCHEMA`).

The decoding methods and their options are the heads': each head's module declares the
methods it offers (`DECODE_METHODS`, `cat.models.heads.DecodeMethod`) and the registry
collects them (`cat.models.registry.decode_methods`); this module merges them into the
`method` choices and the methods' options (`method_options()`), beside the options every
decode has (`COMMON_OPTIONS`), and names no method of its own but `greedy` and `beam`, the
searches every decoding head has. The keys of `hyper-p.json` and of the command line are
flat: a key two methods take is one setting, of one schema and default, which each method
declares with its own meaning (`--help` lists them per method).

`load_model` builds the experiment's model and loads a checkpoint into it after comparing
its config with the one the checkpoint records (`cat.decoding.checkpoint.
check_model_config`): a changed key is an error naming it unless the change is accepted.
`Searcher` decodes a batch with the model's `decode`
(`cat.models.model.AsrModel`: greedy, beam search or a rescoring method, best hypothesis),
or with its `nbest` lists once per shallow-fusion setting (`FusionSpec`, `cat.lm.scorer`)
after one network forward. `plan_batches` groups utterances of similar length within a
budget of padded frames.

Hotwords (`hotwords`, a file of phrases, and `hotwords_score`, their default score per
token; `cat.decoding.context_graph`): the `Searcher` builds their context graph once with
the experiment's tokenizer, and every beam search it runs scores it as a fusion, with the
shallow-fusion LM when there is one (`cat.lm.scorer.CombinedFusion`); `best` then decodes
through the model's `nbest` (its `decode` takes no fusion). Greedy search has no
hypotheses to favour a phrase among: hotwords with method `greedy` are a ValueError. A
file without a usable phrase decodes as without hotwords.

Usage:
    options = DecodeOptions.of_experiment(hyper, "exp/x/hyper-p.json", {"nj": 2})
    searcher = Searcher("exp/x", "exp/x/check/avg-best-5.pt", options, "cpu")
    pairs = searcher.best([Utterance(key, features, NO_LABEL) for key, features in batch])
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cat.core.config import (
    CONFIG_NAME,
    HYPER_NAME,
    ConfigError,
    check_against_schema,
    load_config,
    load_hyper,
    tokenizer_file,
)
from cat.core.io import PathLike, atomic_write
from cat.core.threads import configure_threads
from cat.decoding.checkpoint import check_model_config
from cat.decoding.context_graph import MAX_PHRASE_BONUS, ContextGraph, read_hotwords
from cat.decoding.results import Result
from cat.decoding.timestamps import FRAME_SHIFT_SECONDS, TokenAligner, token_times
from cat.features.fbank import experiment_front_end
from cat.lm.scorer import CombinedFusion, Fusion, ShallowFusion, TokenLM
from cat.loading.batch import Utterance, collate
from cat.models.heads import DecodeOption
from cat.models.registry import build_model, decode_methods
from cat.text.tokenizer import load as load_tokenizer
from cat.training.checkpoint import load_model_state, model_interface, read_model_checkpoint

NO_LABEL = np.zeros(0, np.int32)
#: The options of every decode, whatever the model's heads; `method` and the methods' own
#: options are what the heads declare (`options_schema`).
COMMON_OPTIONS: dict[str, Any] = {
    "beam_size": {"type": "integer", "minimum": 1, "maximum": 1000,
                  "description": "beam width: hypotheses kept per step"},
    "hotwords": {"type": "string", "minLength": 1,
                 "description": "beam searches: a file of phrases to favour (contextual "
                                "biasing), one per line, each with an optional trailing "
                                "' :<score per token>' (relative to the recipe directory)"},
    "hotwords_score": {"type": "number", "minimum": -MAX_PHRASE_BONUS,
                       "maximum": MAX_PHRASE_BONUS,
                       "description": "hotwords: the bonus per token of a phrase that "
                                      "gives no score of its own (a phrase's bonus, "
                                      "times its tokens, at most 1000 either way)"},
    "chunk_size": {"type": "integer", "minimum": 0, "maximum": 10000,
                   "description": "decode in chunks of this many encoder frames (0: full "
                                  "context): the forward of a U2 model with its chunk "
                                  "mask, the chunked forward of a CUSIDE model; what "
                                  "streaming (python -m cat.stream) gives with that "
                                  "chunk size"},
    "right_context": {"enum": ["simulated", "real", "none"],
                      "description": "CUSIDE models in chunks: each chunk's right context "
                                     "(default: simulated with trainer.simu, else real)"},
    "tlg": {"type": "string", "minLength": 1,
            "description": "WFST decoding of the frame posteriors of a CTC model (CTC "
                           "and CRF alike) with the TLG graph in this directory (TLG.fst "
                           "and words.json, which stage 5 builds for each wfst setting) "
                           "instead of the model's searches; word-level results and "
                           "times"},
    "lm_weight": {"type": "number", "exclusiveMinimum": 0,
                  "description": "tlg: the word LM's weight (stage 5's weights.json)"},
    "wfst_beam": {"type": "number", "exclusiveMinimum": 0,
                  "description": "tlg: the WFST decoder's beam"},
    "nj": {"type": "integer", "minimum": 1, "maximum": 1024,
           "description": "CPU decoding processes, each decoding a share of the batches"},
    "max_frames": {"type": "integer", "minimum": 1, "maximum": 100000000,
                   "description": "padded input frames per batch (utterances sorted by "
                                  "length)"},
    "batch_size": {"type": "integer", "minimum": 1, "maximum": 100000,
                   "description": "utterances per batch at most"},
    "device": {"enum": ["auto", "cpu", "cuda"],
               "description": "where to decode; auto: CUDA when available"},
}


def _grouped(meanings: list[tuple[str, str, str]]) -> list[tuple[list[str], list[str], str]]:
    """(methods, heads, description) of (head, method, description) triples, those with
    the same description together, in order."""
    groups: dict[str, tuple[list[str], list[str], str]] = {}
    for head, method, description in meanings:
        methods, heads, _ = groups.setdefault(description, ([], [], description))
        methods.extend([method] if method not in methods else [])
        heads.extend([head] if head not in heads else [])
    return list(groups.values())


def declared_methods() -> dict[str, str]:
    """Every decoding method a head declares (`cat.models.registry.decode_methods`), in
    the registry's order: {method: what it does, per head that offers it}."""
    meanings: dict[str, list[str]] = {}
    for head, method, declaration in decode_methods():
        meanings.setdefault(method, []).append(f"{head}: {declaration.description}")
    return {method: "; ".join(texts) for method, texts in meanings.items()}


def method_options() -> dict[str, DecodeOption]:
    """The options the heads' decoding methods declare, one per key (the key of
    `hyper-p.json` and of the command line): its schema, default and `unused` reason, which
    every method that declares the key must give alike (a ValueError naming the key and
    the heads otherwise), and what each method means by it (the description lists them,
    `<methods> (<head>): <meaning>; ...`)."""
    first: dict[str, tuple[str, DecodeOption]] = {}
    meanings: dict[str, list[tuple[str, str, str]]] = {}
    for head, method, declaration in decode_methods():
        for key, option in declaration.options.items():
            seen = first.setdefault(key, (f"{head}'s {method}", option))
            if (dict(seen[1].schema), seen[1].default, seen[1].unused) != (
                    dict(option.schema), option.default, option.unused):
                raise ValueError(f"decoding option {key!r}: {seen[0]} and {head}'s {method} "
                                 "declare it with another schema, default or unused "
                                 "reason; a key is one setting of hyper-p.json and the "
                                 "command line")
            meanings.setdefault(key, []).append((head, method, option.description))
    return {key: dataclasses.replace(option, description="; ".join(
        f"{' and '.join(methods)} ({', '.join(heads)}): {description}"
        for methods, heads, description in _grouped(meanings[key])))
        for key, (_, option) in first.items()}


def options_schema() -> dict[str, Any]:
    """The JSON schema of `inference.infer.option`'s decoding options (and of the decoding
    command line's flags): `method`, one of the methods the heads declare, the methods'
    options (`method_options`) and `COMMON_OPTIONS`."""
    methods = declared_methods()
    method = {"enum": list(methods),
              "description": "search algorithm, as the model's heads offer it: "
                             + ", ".join(f"{name} ({text})" for name, text in methods.items())}
    declared = {key: {**option.schema, "description": option.description}
                for key, option in method_options().items()}
    return {"type": "object", "additionalProperties": False,
            "properties": {"method": method, "beam_size": COMMON_OPTIONS["beam_size"],
                           **declared, **COMMON_OPTIONS}}


#: Options of `inference.infer.option` that are not search options (and not on the
#: decoding command line, whose flags are those of `options_schema()`).
ACCEPT_SCHEMA: dict[str, Any] = {
    "allow_config_change": {
        "type": "boolean",
        "description": "decode although config.json changed since the checkpoint was "
                       "trained (the changed keys are logged); without it, an error naming "
                       "them"},
}


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """See `COMMON_OPTIONS` and `ACCEPT_SCHEMA`; `method_options`: the options of the
    heads' decoding methods that were given (`method_options()` declares them, `option`
    reads one)."""

    method: str = "beam"
    beam_size: int = 10
    hotwords: str | None = None
    hotwords_score: float = 1.5
    chunk_size: int = 0
    right_context: str | None = None
    tlg: str | None = None
    lm_weight: float = 1.0
    wfst_beam: float = 16.0
    nj: int = 1
    max_frames: int = 40000
    batch_size: int = 64
    device: str = "auto"
    allow_config_change: bool = False
    method_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hotwords is not None and self.tlg is not None:
            raise ValueError("hotwords with tlg: WFST decoding boosts phrases in the graph "
                             "itself; build it with them (stage 5's wfst settings, or "
                             "python -m cat.stream --tlg DIR --lm-arpa ARPA --hotwords FILE)")
        if self.hotwords is not None and self.method == "greedy":
            raise ValueError("hotwords need a beam search (method 'beam' or one of the "
                             "rescoring methods), not greedy")
        if self.method_options:
            unknown = sorted(set(self.method_options) - set(method_options()))
            if unknown:
                raise ValueError(f"{', '.join(unknown)}: no decoding method declares it; "
                                 f"the methods' options are "
                                 f"{', '.join(method_options())}")

    @classmethod
    def from_dict(cls, options: dict[str, Any], source: str) -> DecodeOptions:
        schema = options_schema()
        schema["properties"].update(ACCEPT_SCHEMA)
        check_against_schema(options, schema, source)
        declared = method_options()
        try:
            return cls(**{key: value for key, value in options.items() if key not in declared},
                       method_options={key: value for key, value in options.items()
                                       if key in declared})
        except ValueError as error:
            raise ConfigError(f"{source}: {error}") from None

    @classmethod
    def of_experiment(cls, hyper: dict[str, Any], source: str,
                      overrides: dict[str, Any]) -> DecodeOptions:
        """`inference.infer.option` of `hyper` (from the file `source`), then the
        `overrides` that are not None."""
        options = dict(hyper.get("inference", {}).get("infer", {}).get("option", {}))
        options.update({key: value for key, value in overrides.items() if value is not None})
        return cls.from_dict(options, f"{source}: inference.infer.option")

    def option(self, name: str) -> Any:
        """The value of the methods' option `name`: the one given, else its declared
        default (KeyError for a name no method declares)."""
        if name in self.method_options:
            return self.method_options[name]
        return method_options()[name].default

    def search_settings(self, accepted: Sequence[str], source: str) -> dict[str, Any]:
        """The keyword arguments of a model's `decode` and `nbest` for `method`: the options
        named by `accepted` (what the model takes with this method:
        `AsrModel.method_settings`, the options its heads' methods declare). An option
        given a value other than its default that the model's method does not take, and
        whose declaration gives a reason for refusing it (`DecodeOption.unused`), is a
        ValueError naming `source`, the option and the reason."""
        declared = method_options()
        for name, value in self.method_options.items():
            reason = declared[name].unused
            if reason is not None and name not in accepted and value != declared[name].default:
                raise ValueError(f"{source}: {name}: {reason}")
        return {name: self.option(name) for name in accepted}

    def record(self) -> dict[str, Any]:
        """The options as `decode.log` records them: `method`, `beam_size`, every option of
        the methods (its default when not given), then the others."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                  if field.name != "method_options"}
        first = {key: values.pop(key) for key in ("method", "beam_size")}
        return {**first, **{name: self.option(name) for name in method_options()}, **values}

    def resolved_device(self) -> str:
        """`cpu` or `cuda` (`auto`: cuda when torch sees a GPU)."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclasses.dataclass(frozen=True)
class DecodeSummary:
    """What one decoding run did."""

    num_utts: int
    audio_seconds: float
    decode_seconds: float
    num_skipped: int = 0

    @property
    def rtf(self) -> float:
        return self.decode_seconds / self.audio_seconds if self.audio_seconds else 0.0


@dataclasses.dataclass(frozen=True)
class FusionSpec:
    """Shallow fusion of a token-level n-gram (ARPA or kenlm binary `lm`), optionally
    with LODR (`lodr`, subtracted with `lodr_weight`); see `cat.lm.scorer`."""

    lm: str
    alpha: float
    beta: float = 0.0
    lodr: str | None = None
    lodr_weight: float = 0.0

    def build(self, pieces: list[str], models: dict[str, TokenLM]) -> ShallowFusion:
        """The scorer, loading each LM file once per process (`models` caches them)."""
        for path in (self.lm, self.lodr):
            if path is not None and path not in models:
                models[path] = TokenLM(path, pieces)
        return ShallowFusion(models[self.lm], self.alpha, self.beta,
                             models[self.lodr] if self.lodr else None, self.lodr_weight)


def load_model(exp_dir: PathLike, checkpoint: PathLike, device: torch.device,
               allow_config_change: bool | None = None
               ) -> tuple[torch.nn.Module, Any]:
    """The experiment's model (eval mode, on `device`) with `checkpoint`'s weights, and its
    tokenizer. The weights must fit the model built from `config.json`
    (`CheckpointMismatchError`), and `config.json`, the front end (`data.front_end`) and
    the tokenizer must be those the checkpoint was trained with (`ModelConfigChangedError`
    naming the changed keys) unless `allow_config_change` (None:
    `inference.infer.option.allow_config_change` of `hyper-p.json`)."""
    exp_dir = Path(exp_dir)
    hyper = load_hyper(exp_dir / HYPER_NAME)
    config = load_config(exp_dir / CONFIG_NAME)
    if allow_config_change is None:
        allow_config_change = DecodeOptions.of_experiment(
            hyper, str(exp_dir / HYPER_NAME), {}).allow_config_change
    tokenizer = load_tokenizer(tokenizer_file(hyper, str(exp_dir / HYPER_NAME)))
    model = build_model(config, tokenizer.vocab_size, str(exp_dir / CONFIG_NAME))
    state, meta = read_model_checkpoint(checkpoint)
    load_model_state(model, state, checkpoint, exp_dir / CONFIG_NAME)
    check_model_config(meta, config, checkpoint, exp_dir / CONFIG_NAME, allow_config_change,
                       model_interface(experiment_front_end(hyper), tokenizer))
    return model.to(device).eval(), tokenizer


def plan_batches(lengths: dict[str, int], max_frames: int, batch_size: int) -> list[list[str]]:
    """Utterance ids grouped by similar length, each group within the padded-frame budget."""
    ordered = sorted(lengths, key=lambda key: (lengths[key], key))
    batches: list[list[str]] = []
    current: list[str] = []
    for key in ordered:
        # Sorted ascending: the newest utterance is the longest of the group.
        if current and (lengths[key] * (len(current) + 1) > max_frames
                        or len(current) >= batch_size):
            batches.append(current)
            current = []
        current.append(key)
    if current:
        batches.append(current)
    return batches


#: An N-best list: (text, score) pairs, best first.
NBest = list[tuple[str, float]]


class Searcher:
    """One process's model, tokenizer, LM scorers and hotwords, decoding batches of
    utterances.

    With `device` cpu the process uses one torch thread: processes are the unit of
    parallelism. `forward_seconds` and `search_seconds` (one per fusion spec) add up the
    time `nbest` spent. `hotwords`: the context graph of `options.hotwords`, None without
    hotwords or when the file has no usable phrase.
    """

    def __init__(self, exp_dir: PathLike, checkpoint: PathLike,
                 options: DecodeOptions, device: str,
                 specs: Sequence[FusionSpec | None] = ()) -> None:
        if device == "cpu":
            configure_threads(1)  # processes (--nj) are the unit of parallelism
        self.device = torch.device(device)
        self.options = options
        self.model, self.tokenizer = load_model(exp_dir, checkpoint, self.device,
                                                options.allow_config_change)
        if options.method not in self.model.decode_methods:
            raise ValueError(f"{Path(exp_dir) / CONFIG_NAME}: this model decodes with "
                             f"{', '.join(self.model.decode_methods)}, not {options.method}")
        self.search = options.search_settings(self.model.method_settings(options.method),
                                              str(Path(exp_dir) / CONFIG_NAME))
        try:
            self.model.set_decode_chunk_size(options.chunk_size, options.right_context)
        except ValueError as error:
            raise ValueError(f"{Path(exp_dir) / CONFIG_NAME}: {error}") from None
        pieces = [self.tokenizer.id_to_piece(i) for i in range(self.tokenizer.vocab_size)]
        models: dict[str, TokenLM] = {}
        self.fusions = [spec.build(pieces, models) if spec is not None else None
                        for spec in specs]
        self.hotwords = self._read_hotwords()
        self.forward_seconds = 0.0
        self.search_seconds = [0.0] * len(self.fusions)

    def _read_hotwords(self) -> ContextGraph | None:
        if self.options.hotwords is None:
            return None
        graph, _ = read_hotwords(self.options.hotwords, self.tokenizer,
                                 self.options.hotwords_score)
        return graph if graph.num_phrases else None

    def _with_hotwords(self, fusion: Fusion | None) -> Fusion | None:
        """What the beam search scores besides the acoustics: `fusion` and the hotwords."""
        if self.hotwords is None:
            return fusion
        return self.hotwords if fusion is None else CombinedFusion([fusion, self.hotwords])

    def best(self, utterances: Sequence[Utterance]) -> list[tuple[str, str]]:
        """(key, best hypothesis) of each utterance, with `options.method` (with hotwords,
        the first of the model's N-best lists searched with them)."""
        if self.hotwords is not None:
            return self._best_with_hotwords(utterances)
        batch = collate(utterances)
        with torch.inference_mode():
            hyps = self.model.decode(batch.feats.to(self.device),
                                     batch.feat_lens.to(self.device),
                                     method=self.options.method,
                                     beam_size=self.options.beam_size, **self.search)
        return [(u.key, self.tokenizer.decode(list(hyp)))
                for u, hyp in zip(utterances, hyps, strict=True)]

    def _best_with_hotwords(self, utterances: Sequence[Utterance]) -> list[tuple[str, str]]:
        batch = collate(utterances)
        with torch.inference_mode():
            encoded = self.model.search_inputs(batch.feats.to(self.device),
                                               batch.feat_lens.to(self.device))
            nbest = self.model.nbest(encoded, self.options.beam_size, self.hotwords,
                                     self.options.method, **self.search)
        return [(u.key, self.tokenizer.decode(hyps[0][0] if hyps else []))
                for u, hyps in zip(utterances, nbest, strict=True)]

    def results(self, utterances: Sequence[Utterance], timestamps: bool = True) -> list[Result]:
        """A `Result` of each utterance: the hypothesis `best` gives (with the first fusion
        spec, when there is one), its pieces, with `timestamps` their times
        (`cat.decoding.timestamps`; a ValueError for a model that is no `TokenAligner`),
        and for beam searches the N-best list with scores. One network forward per batch,
        two with method greedy (its search reads the features)."""
        if timestamps and not isinstance(self.model.first_head, TokenAligner):
            raise ValueError(f"{type(self.model.first_head).__name__} heads give no token "
                             "times")
        batch = collate(utterances)
        feats, feat_lens = batch.feats.to(self.device), batch.feat_lens.to(self.device)
        fusion = self._with_hotwords(self.fusions[0] if self.fusions else None)
        with torch.inference_mode():
            inputs = self.model.search_inputs(feats, feat_lens)
            if self.options.method == "greedy":
                hyps = self.model.decode(feats, feat_lens, method="greedy",
                                         beam_size=self.options.beam_size, **self.search)
                nbests: list[Any] = [None] * len(hyps)
            else:
                nbests = self.model.nbest(inputs, self.options.beam_size, fusion,
                                          self.options.method, **self.search)
                hyps = [hyps[0][0] if hyps else [] for hyps in nbests]
            spans = (self.model.first_head.token_frames(*inputs, hyps) if timestamps
                     else None)
        factor = int(self.model.encoder.frame_rate_factor)
        results = []
        for index, (utterance, tokens) in enumerate(zip(utterances, hyps, strict=True)):
            pieces = tuple(self.tokenizer.id_to_piece(int(token)) for token in tokens)
            times = None if spans is None else tuple(token_times(
                spans[index], factor, pieces,
                int(batch.feat_lens[index]) * FRAME_SHIFT_SECONDS))
            nbest = None if nbests[index] is None else tuple(
                (self.tokenizer.decode(candidate), float(score))
                for candidate, score in nbests[index])
            results.append(Result(utterance.key, self.tokenizer.decode(list(tokens)), pieces,
                                  times, nbest, tuple(int(token) for token in tokens)))
        return results

    def nbest(self, utterances: Sequence[Utterance]) -> list[list[tuple[str, NBest]]]:
        """Per fusion spec, (key, N-best list) of each utterance (beam search with the
        spec's LM and the hotwords, ranked again by another head with a rescoring
        method)."""
        with torch.inference_mode():
            start = time.perf_counter()
            batch = collate(utterances)
            encoded = self.model.search_inputs(batch.feats.to(self.device),
                                               batch.feat_lens.to(self.device))
            self.forward_seconds += time.perf_counter() - start
            results = []
            for index, fusion in enumerate(self.fusions):
                start = time.perf_counter()
                nbest = self.model.nbest(encoded, self.options.beam_size,
                                         self._with_hotwords(fusion), self.options.method,
                                         **self.search)
                self.search_seconds[index] += time.perf_counter() - start
                results.append([(u.key, [(self.tokenizer.decode(tokens), score)
                                         for tokens, score in hyps])
                                for u, hyps in zip(utterances, nbest, strict=True)])
        return results


def write_hyp(path: PathLike, pairs: Iterable[tuple[str, str]]) -> None:
    """`<utt> <hypothesis>` lines sorted by utterance, atomically (an empty hypothesis is
    the id alone, so a scorer sees it and counts deletions)."""
    with atomic_write(path) as f:
        for key, text in sorted(pairs):
            f.write(f"{key} {text}\n" if text else f"{key}\n")


def searcher_for(exp_dir: PathLike, checkpoint: PathLike, options: DecodeOptions,
                 device: str, specs: Sequence[FusionSpec | None] = ()) -> Searcher:
    """The searcher of `options`: with `tlg`, `cat.decoding.wfst.TlgSearcher` (the WFST
    code is imported only then), else the model's `Searcher`."""
    if options.tlg is not None:
        from cat.decoding.wfst import TlgSearcher

        return TlgSearcher(exp_dir, checkpoint, options, device, list(specs))
    return Searcher(exp_dir, checkpoint, options, device, list(specs))
