"""Stage 5 of the recipes: language models, their weights tuned on dev, decoding with them.

`hyper-p.json`'s `inference.lm` names the LM experiments (`exp/lm-*`, trained from their
`lm.json` by `cat.lm.train` unless up to date) and the settings to decode with (token-level
shallow fusion with `alpha`/`beta`, LODR with `lodr_weight`, N-best rescoring with a word
LM); a weight given as a list is searched on the dev set, where every point of the grid
is one pass of a single decoding run (one network forward). The chosen weights go to
`exp/<name>/decode-lm/<setting>/weights.json`, the test sets are decoded with them, and
the table goes to `exp/<name>/RESULTS-lm.md`.

With `--cmd "$decode_cmd"` (a `cat.core.launch.Launcher`) the work runs as array jobs
(`cat.core.launch.map_calls`), each task's log under the directory named below, while
choosing weights, rescoring, scoring and the table stay in this process; the figures are
those of the run without `--cmd` (timings aside):

* the LMs the settings name that are not up to date: one task each, first
  (`exp/<name>/decode-lm/log/train-lm.<task>.log`);
* the TLG graphs of the `wfst` settings that are not up to date: one task each
  (`decode-lm/log/tlg.<task>.log`);
* the first passes of a set (`cat.decoding.inference.decode_passes`): `nj` tasks
  (`decode-lm/first-pass/<set>/log/decode.<task>.log`);
* the WFST decoding of a set for a `wfst` setting: `nj` tasks, each computing the
  log-posteriors of its share of the set's batches and decoding them at every weight
  asked, the dev grid or the chosen weight
  (`decode-lm/<setting>/log/wfst-<set>.<task>.log`).

Usage:
    python -m cat.stages.driver lm exp/synth-ctc-short --nj 2
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cat.core.config import (
    HYPER_NAME,
)
from cat.core.io import PathLike, atomic_write
from cat.core.launch import Launcher, map_calls
from cat.core.stages import is_done, mark_done, signature
from cat.stages.plan import Plan, select_checkpoint, set_name

logger = logging.getLogger(__name__)

LM_DIR_NAME = "decode-lm"
LM_RESULTS_NAME = "RESULTS-lm.md"


def _lm_signature(lm_dir: Path) -> tuple[dict[str, Any], str]:
    """An LM experiment's `lm.json` and the signature of its inputs (which must exist)."""
    from cat.lm.train import input_files, load_lm_config

    config = load_lm_config(lm_dir)
    for path in input_files(config):
        if not path.is_file():
            raise FileNotFoundError(f"{lm_dir / 'lm.json'}: {path} does not exist (the "
                                    "data stages, or the synthetic LM text, come first)")
    return config, signature("lm", config, files=input_files(config))


def lm_up_to_date(lm_dir: PathLike) -> bool:
    """True when `train_lm(lm_dir)` has nothing to estimate."""
    from cat.lm.train import ARPA_NAME, model_file

    config, sig = _lm_signature(Path(lm_dir))
    return is_done(Path(lm_dir) / ARPA_NAME, sig) and model_file(lm_dir, config).is_file()


def train_lm(lm_dir: PathLike) -> Path:
    """Estimate `lm_dir/lm.json`'s n-gram unless `lm_dir/lm.arpa` is up to date; returns the
    file the decoders load (`lm.bin` when lm.json sets `binary`, else `lm.arpa`)."""
    from cat.lm.train import ARPA_NAME, model_file
    from cat.lm.train import train as train_ngram

    lm_dir = Path(lm_dir)
    config, sig = _lm_signature(lm_dir)
    arpa = lm_dir / ARPA_NAME
    if is_done(arpa, sig) and model_file(lm_dir, config).is_file():
        logger.info("%s is up to date", arpa)
        return model_file(lm_dir, config)
    train_ngram(lm_dir)
    mark_done(arpa, sig)
    return model_file(lm_dir, config)


def _grid(value: float | list[float] | None, default: float = 0.0) -> list[float]:
    if value is None:
        return [default]
    return [float(v) for v in value] if isinstance(value, list) else [float(value)]


def _pass_name(spec: Any) -> str:
    if spec is None:
        return "nolm"
    name = f"{Path(spec.lm).parent.name}-a{spec.alpha:g}-b{spec.beta:g}"
    if spec.lodr:
        name += f"-{Path(spec.lodr).parent.name}-w{spec.lodr_weight:g}"
    return name


@dataclasses.dataclass
class LMRun:
    """Stage 5 of one experiment: its plan, checkpoint, decoding options and LMs."""

    plan: Plan
    checkpoint: Path
    option: dict[str, Any]
    options: Any
    unit: str
    models: dict[str, Path] = dataclasses.field(default_factory=dict)
    posteriors: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: runs the stage's jobs as array tasks (None: in this process and its pool)
    launcher: Launcher | None = None

    @property
    def root(self) -> Path:
        return self.plan.exp_dir / LM_DIR_NAME

    def where(self, key: str) -> str:
        return f"{self.plan.exp_dir / HYPER_NAME}: inference.lm.{key}"

    def check_unit(self, lm_dir: str, key: str, token_level: bool) -> None:
        """Fusion (`token_level`) needs an LM of the ASR tokens, not of words."""
        from cat.core.config import ConfigError
        from cat.lm.train import load_lm_config

        if token_level and load_lm_config(lm_dir)["unit"] == "word":
            raise ConfigError(f"{self.where(key)}: {lm_dir} is a word-level model; shallow "
                              "fusion scores the ASR tokens (unit char or tokenizer); use "
                              "word models under 'rescore'")

    def lm(self, lm_dir: str, key: str, token_level: bool) -> Path:
        """The model file of an LM experiment (trained when needed); fusion needs ASR
        tokens."""
        if lm_dir not in self.models:
            self.check_unit(lm_dir, key, token_level)
            self.models[lm_dir] = train_lm(lm_dir)
        return self.models[lm_dir]

    def first_passes(self, data_dir: str, specs: list[Any]) -> list[Path]:
        """Output dirs of first passes of `data_dir` (decoding those not up to date in one
        run, sharing the network forward)."""
        from cat.decoding.inference import decode_passes

        outs = []
        missing: dict[Path, tuple[Any, str]] = {}
        for spec in specs:
            out = self.root / "first-pass" / set_name(data_dir) / _pass_name(spec)
            files = [self.checkpoint, Path(data_dir) / "feats.scp"]
            if spec is not None:
                files += [Path(spec.lm)] + ([Path(spec.lodr)] if spec.lodr else [])
            sig = signature("lm-pass", self.option,
                            dataclasses.asdict(spec) if spec is not None else None, files=files)
            outs.append(out)
            if not is_done(out / "hyp", sig):
                missing[out] = (spec, sig)
        if missing:
            decode_passes(self.plan.exp_dir, data_dir, self.checkpoint, self.options,
                          [(spec, out) for out, (spec, _) in missing.items()], self.launcher,
                          self.root / "first-pass" / set_name(data_dir) / "log")
            for out, (_, sig) in missing.items():
                mark_done(out / "hyp", sig)
        return outs

    def score(self, data_dir: str, hyps: dict[str, str], words: bool = False) -> Any:
        """Error rate of `hyps`; those of a phone model's searches (not `words`, as WFST
        decoding gives) against the references in phones."""
        from cat.core.io import read_table
        from cat.scoring import score
        from cat.stages.plan import phone_references

        refs = read_table(Path(data_dir) / "text", allow_empty_value=True)
        phones = None if words else phone_references(self.plan, refs)
        if phones is not None:
            return score(phones, hyps, "word")
        return score(refs, hyps, self.unit)


def _named_lms(settings: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(LM dir, key, token level) of every LM the settings name."""
    named = []
    for name, setting in settings.items():
        fusion = setting.get("fusion", {})
        named += [(fusion[key], f"settings.{name}.fusion.{key}", True)
                  for key in ("lm", "lodr") if key in fusion]
        named += [(setting[key]["lm"], f"settings.{name}.{key}.lm", False)
                  for key in ("rescore", "wfst") if key in setting]
    return named


def train_lms(run: LMRun, settings: dict[str, Any]) -> None:
    """Estimate the LMs the settings name that are not up to date as the tasks of one
    array of `run.launcher` (logs in `decode-lm/log/`)."""
    stale: list[str] = []
    for lm_dir, key, token_level in _named_lms(settings):
        run.check_unit(lm_dir, key, token_level)
        if lm_dir not in stale and not lm_up_to_date(lm_dir):
            stale.append(lm_dir)
    if stale:
        map_calls(run.launcher, "train-lm", train_lm, [(lm_dir,) for lm_dir in stale],
                  run.root / "log", parallel=len(stale))


def _fusion_specs(run: LMRun, name: str, fusion: dict[str, Any]) -> list[Any]:
    from cat.decoding.inference import FusionSpec

    key = f"settings.{name}.fusion"
    lm = str(run.lm(fusion["lm"], f"{key}.lm", token_level=True))
    lodr = str(run.lm(fusion["lodr"], f"{key}.lodr", token_level=True)) \
        if "lodr" in fusion else None
    return [FusionSpec(lm, alpha, beta, lodr, weight)
            for alpha in _grid(fusion["alpha"]) for beta in _grid(fusion.get("beta"))
            for weight in _grid(fusion.get("lodr_weight"))]


def tune_setting(run: LMRun, name: str, setting: dict[str, Any], dev: str) -> dict[str, Any]:
    """Choose a setting's weights on `dev`; returns (and writes) `weights.json`."""
    from cat.core.io import read_table
    from cat.lm.rescore import NBEST_NAME, NBestScores, read_nbest
    from cat.lm.scorer import WordRescorer
    from cat.lm.text import make_splitter
    from cat.lm.train import load_lm_config

    if "wfst" in setting:
        return _tune_wfst(run, name, setting["wfst"], dev)
    report: dict[str, Any] = {"dev": dev, "fusion": None, "rescore": None,
                              "fusion_grid": [], "rescore_grid": []}
    specs = _fusion_specs(run, name, setting["fusion"]) if "fusion" in setting else [None]
    outs = run.first_passes(dev, specs)
    best_spec, best_out, best_error = None, outs[0], float("inf")
    for spec, out in zip(specs, outs, strict=True):
        result = run.score(dev, read_table(out / "hyp", allow_empty_value=True))
        if spec is not None:
            report["fusion_grid"].append({**_spec_weights(spec), "error_rate": result.error_rate})
        if result.error_rate < best_error:
            best_spec, best_out, best_error = spec, out, result.error_rate
    report["fusion"] = _spec_weights(best_spec) if best_spec is not None else None
    if "rescore" in setting:
        rescore = setting["rescore"]
        arpa = run.lm(rescore["lm"], f"settings.{name}.rescore.lm", token_level=False)
        config = load_lm_config(rescore["lm"])
        rescorer = WordRescorer(arpa, make_splitter(config["unit"], config.get("tokenizer")))
        scores = NBestScores.compute(read_nbest(best_out / NBEST_NAME), rescorer)
        best = None
        grid = list(itertools.product(_grid(rescore["alpha"]), _grid(rescore.get("beta"))))
        for alpha, beta in tqdm(grid, desc=f"{name}: rescoring weights on {set_name(dev)}",
                                unit="point", disable=None):
            error = run.score(dev, scores.best(alpha, beta)).error_rate
            report["rescore_grid"].append({"alpha": alpha, "beta": beta, "error_rate": error})
            if best is None or error < best[2]:
                best = (alpha, beta, error)
        report["rescore"] = {"alpha": best[0], "beta": best[1]}
        best_error = best[2]
    report["dev_error_rate"] = best_error
    path = run.root / name / "weights.json"
    with atomic_write(path) as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    logger.info("%s: weights chosen on %s: fusion %s, rescoring %s (%.2f %%)", name, dev,
                report["fusion"], report["rescore"], best_error)
    return report


def _chosen_spec(run: LMRun, name: str, setting: dict[str, Any], weights: dict[str, Any]) -> Any:
    """The fusion spec of a setting's grid that `weights` (from `tune_setting`) chose."""
    return next(spec for spec in _fusion_specs(run, name, setting["fusion"])
                if _spec_weights(spec) == weights["fusion"])


def _spec_weights(spec: Any) -> dict[str, float]:
    weights = {"alpha": spec.alpha, "beta": spec.beta}
    if spec.lodr:
        weights["lodr_weight"] = spec.lodr_weight
    return weights


def decode_setting(run: LMRun, name: str, setting: dict[str, Any] | None,
                   weights: dict[str, Any] | None, test: str) -> tuple[Any, float]:
    """Decode and score one test set with a setting's chosen weights: (result, RTF)."""
    from cat.core.io import read_table
    from cat.lm.rescore import NBEST_NAME, NBestScores, read_nbest, write_hyp
    from cat.lm.scorer import WordRescorer
    from cat.lm.text import make_splitter
    from cat.lm.train import load_lm_config
    from cat.scoring import format_summary

    if setting is not None and "wfst" in setting:
        return _decode_wfst(run, name, setting["wfst"], weights, test)
    spec = None
    if setting is not None and "fusion" in setting:
        spec = _chosen_spec(run, name, setting, weights)
    out = run.first_passes(test, [spec])[0]
    target = run.root / name / set_name(test)
    rescore = setting.get("rescore") if setting is not None else None
    files = [out / "hyp", out / NBEST_NAME]
    if rescore is not None:
        files.append(run.lm(rescore["lm"], f"settings.{name}.rescore.lm", token_level=False))
    sig = signature("lm-setting", weights, files=files)
    if is_done(target / "hyp", sig):
        hyps = read_table(target / "hyp", allow_empty_value=True)
        rtf = json.loads((target / "decode.json").read_text(encoding="utf-8"))["rtf"]
    else:
        log = json.loads((out / "decode.log").read_text(encoding="utf-8"))
        seconds = log["decode_seconds"]
        hyps = read_table(out / "hyp", allow_empty_value=True)
        if rescore is not None:
            start = time.perf_counter()
            config = load_lm_config(rescore["lm"])
            rescorer = WordRescorer(files[-1], make_splitter(config["unit"],
                                                             config.get("tokenizer")))
            scores = NBestScores.compute(read_nbest(out / NBEST_NAME), rescorer)
            hyps = scores.best(weights["rescore"]["alpha"], weights["rescore"]["beta"])
            seconds += time.perf_counter() - start
        rtf = seconds / log["audio_seconds"] if log["audio_seconds"] else 0.0
        write_hyp(target / "hyp", hyps)
        with atomic_write(target / "decode.json") as f:
            json.dump({"first_pass": str(out), "weights": weights, "seconds": round(seconds, 2),
                       "rtf": round(rtf, 4)}, f, indent=1)
            f.write("\n")
        mark_done(target / "hyp", sig)
    result = run.score(test, hyps)
    with atomic_write(target / "score.txt") as f:
        f.write(format_summary(result) + "\n")
    return result, rtf


def decode_lm(exp_dir: PathLike, nj: int = 1, launcher: Launcher | None = None) -> Path | None:
    """Stage 5: tune, decode and score every `inference.lm` setting; returns the table's
    path, or None when the experiment names no language model. With a `launcher` the LMs,
    TLG graphs, first passes and WFST decoding run as array tasks (see the module doc)."""
    from cat.decoding.inference import DecodeOptions

    plan = Plan.load(exp_dir)
    inference = plan.hyper.get("inference", {})
    section = inference.get("lm")
    if not section:
        logger.info("%s sets no inference.lm: no language model to decode with",
                    plan.exp_dir / HYPER_NAME)
        return None
    option = {"nj": nj, **inference.get("infer", {}).get("option", {})}
    options = DecodeOptions.from_dict(option, f"{plan.exp_dir / HYPER_NAME}: "
                                              "inference.infer.option")
    unit = "char" if inference.get("er", {}).get("cer", True) else "word"
    run = LMRun(plan, select_checkpoint(plan), option, options, unit, launcher=launcher)
    dev = section.get("dev") or plan.section("dev")[0]
    tests = plan.section("test")
    settings = section["settings"]
    if launcher is not None:
        train_lms(run, settings)
        build_graphs(run, settings)
    # Every first pass a set needs is decoded in one run, sharing the network forward.
    run.first_passes(dev, [None, *(spec for name, setting in settings.items()
                                   if "fusion" in setting
                                   for spec in _fusion_specs(run, name, setting["fusion"]))])
    chosen = {name: tune_setting(run, name, setting, dev) for name, setting in settings.items()}
    for test in tests:
        run.first_passes(test, [None, *(_chosen_spec(run, name, setting, chosen[name])
                                        for name, setting in settings.items()
                                        if "fusion" in setting)])
    rows = [("none", None, [decode_setting(run, "none", None, None, t) for t in tests])]
    rows += [(name, chosen[name], [decode_setting(run, name, setting, chosen[name], t)
                                   for t in tests]) for name, setting in settings.items()]
    path = plan.exp_dir / LM_RESULTS_NAME
    with atomic_write(path) as f:
        f.write(_lm_table(run, dev, tests, rows))
    return path


# --------------------------------------------------------------- WFST (TLG) decoding


#: A wfst setting's TLG: (tokenizer file, word ARPA, graph dir, hotwords: (file, default
#: score) or None).
GraphJob = tuple[str, Path, Path, "tuple[str, float] | None"]


def _graph_job(run: LMRun, name: str, wfst: dict[str, Any]) -> tuple[GraphJob, str]:
    """A wfst setting's TLG and its signature (the hotwords of `inference.infer.option`
    included: they are boosted in the graph)."""
    arpa = run.lm(wfst["lm"], f"settings.{name}.wfst.lm", token_level=False)
    if arpa.suffix != ".arpa":
        arpa = arpa.with_name("lm.arpa")
    tokenizer = run.plan.options.tokenizer
    options = run.options
    hotwords = ((str(options.hotwords), float(options.hotwords_score))
                if options.hotwords is not None else None)
    files = [arpa, Path(tokenizer)] + ([Path(hotwords[0])] if hotwords else [])
    sig = signature("tlg", *([hotwords[1]] if hotwords else []), files=files)
    return (tokenizer, arpa, run.root / name / "graph", hotwords), sig


def _load_graph(job: GraphJob) -> Any:
    """The graph of `job`, built unless its directory holds it."""
    from cat.decoding.wfst import decoding_graph, hotword_boosts
    from cat.text.tokenizer import load as load_tokenizer

    tokenizer_file, arpa, out, hotwords = job
    tokenizer = load_tokenizer(tokenizer_file)
    boosts = hotword_boosts(hotwords[0], tokenizer, hotwords[1]) if hotwords else None
    return decoding_graph(tokenizer, arpa, out, boosts)


def _clear_graph(out: Path) -> None:
    for stale in ("TLG.fst", "words.json"):
        (out / stale).unlink(missing_ok=True)


def build_graph(job: GraphJob) -> None:
    """Build the TLG of `job` into its directory afresh (a task of the TLG array)."""
    _clear_graph(job[2])
    _load_graph(job)


def build_graphs(run: LMRun, settings: dict[str, Any]) -> None:
    """Build the TLG graphs of the wfst settings that are not up to date as the tasks of
    one array of `run.launcher` (logs in `decode-lm/log/`)."""
    jobs = [_graph_job(run, name, setting["wfst"]) for name, setting in settings.items()
            if "wfst" in setting]
    stale = [(job, sig) for job, sig in jobs if not is_done(job[2], sig)]
    if stale:
        map_calls(run.launcher, "tlg", build_graph, [(job,) for job, _ in stale],
                  run.root / "log", parallel=len(stale))
        for job, sig in stale:
            mark_done(job[2], sig)


def _wfst_graph(run: LMRun, name: str, wfst: dict[str, Any]) -> Any:
    job, sig = _graph_job(run, name, wfst)
    if not is_done(job[2], sig):
        _clear_graph(job[2])
    graph = _load_graph(job)
    mark_done(job[2], sig)
    return graph


def _decode_at(graph: Any, posteriors: dict[str, Any], wfst: dict[str, Any],
               lm_weight: float) -> dict[str, str]:
    from cat.decoding.wfst import decode_all

    return decode_all(graph, posteriors, float(wfst.get("acoustic_scale", 1.0)), lm_weight,
                      float(wfst.get("beam", 16.0)))


def _wfst_hyps(run: LMRun, name: str, wfst: dict[str, Any], lm_weight: float,
               data_dir: str) -> tuple[dict[str, str], float]:
    """Hypotheses of `data_dir` with TLG at `lm_weight` and the decoding seconds (the
    forward, done once per set, counts for each weight), in this process."""
    from cat.decoding.wfst import log_posteriors

    graph = _wfst_graph(run, name, wfst)
    if data_dir not in run.posteriors:
        start = time.perf_counter()
        posteriors = log_posteriors(run.plan.exp_dir, run.checkpoint, data_dir, run.options)
        run.posteriors[data_dir] = (posteriors, time.perf_counter() - start)
    posteriors, forward = run.posteriors[data_dir]
    start = time.perf_counter()
    hyps = _decode_at(graph, posteriors, wfst, lm_weight)
    return hyps, forward + time.perf_counter() - start


def wfst_share(exp_dir: str, checkpoint: str, data_dir: str, options: Any,
               batches: list[list[str]], graph_job: GraphJob,
               wfst: dict[str, Any], weights: list[float]
               ) -> dict[float, tuple[dict[str, str], float]]:
    """A task of a set's WFST array: the log-posteriors of `batches` decoded with the TLG
    at each of `weights`: {weight: (hypotheses, seconds of the forward and the search)}."""
    from cat.decoding.wfst import log_posteriors

    graph = _load_graph(graph_job)
    start = time.perf_counter()
    posteriors = log_posteriors(exp_dir, checkpoint, data_dir, options, batches)
    forward = time.perf_counter() - start
    decoded = {}
    for weight in weights:
        start = time.perf_counter()
        hyps = _decode_at(graph, posteriors, wfst, weight)
        decoded[weight] = (hyps, forward + time.perf_counter() - start)
    return decoded


def _wfst_array(run: LMRun, name: str, wfst: dict[str, Any], weights: list[float],
                data_dir: str) -> dict[float, tuple[dict[str, str], float]]:
    """`_wfst_decodes` as `nj` tasks of an array, each a share of the set's batches."""
    from cat.decoding.inference import plan_batches, read_lengths

    job, sig = _graph_job(run, name, wfst)
    if not is_done(job[2], sig):
        build_graph(job)
        mark_done(job[2], sig)
    options = run.options
    batches = plan_batches(read_lengths(Path(data_dir)), options.max_frames,
                           options.batch_size)
    shares = max(1, min(options.nj, len(batches)))
    calls = [(str(run.plan.exp_dir), str(run.checkpoint), data_dir, options,
              batches[i::shares], job, wfst, weights)
             for i in range(shares)]
    results = map_calls(run.launcher, f"wfst-{set_name(data_dir)}", wfst_share, calls,
                        run.root / name / "log", parallel=shares)
    return {weight: ({key: hyp for result in results for key, hyp in result[weight][0].items()},
                     sum(result[weight][1] for result in results)) for weight in weights}


def _wfst_decodes(run: LMRun, name: str, wfst: dict[str, Any], weights: list[float],
                  data_dir: str) -> dict[float, tuple[dict[str, str], float]]:
    """{weight: (hypotheses of `data_dir` with TLG at that LM weight, decoding seconds)}:
    here, or as array tasks with `run.launcher`."""
    if run.launcher is not None:
        return _wfst_array(run, name, wfst, weights, data_dir)
    return {weight: _wfst_hyps(run, name, wfst, weight, data_dir) for weight in weights}


def _tune_wfst(run: LMRun, name: str, wfst: dict[str, Any], dev: str) -> dict[str, Any]:
    report: dict[str, Any] = {"dev": dev, "wfst_grid": []}
    best = None
    weights = _grid(wfst.get("lm_weight"), 1.0)
    decoded = _wfst_decodes(run, name, wfst, weights, dev)
    for weight in weights:
        error = run.score(dev, decoded[weight][0], words=True).error_rate
        report["wfst_grid"].append({"lm_weight": weight, "error_rate": error})
        if best is None or error < best[1]:
            best = (weight, error)
    report["wfst"] = {"lm_weight": best[0]}
    report["dev_error_rate"] = best[1]
    with atomic_write(run.root / name / "weights.json") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    logger.info("%s: TLG lm_weight %g chosen on %s (%.2f %%)", name, best[0], dev, best[1])
    return report


def _decode_wfst(run: LMRun, name: str, wfst: dict[str, Any], weights: dict[str, Any],
                 test: str) -> tuple[Any, float]:
    from cat.lm.rescore import write_hyp
    from cat.scoring import format_summary

    target = run.root / name / set_name(test)
    weight = weights["wfst"]["lm_weight"]
    hyps, seconds = _wfst_decodes(run, name, wfst, [weight], test)[weight]
    audio = float(json.loads((run.plan.exp_dir / "decode" / set_name(test) / "decode.log")
                             .read_text(encoding="utf-8")).get("audio_seconds", 0.0)) \
        if (run.plan.exp_dir / "decode" / set_name(test) / "decode.log").is_file() else 0.0
    rtf = seconds / audio if audio else 0.0
    write_hyp(target / "hyp", hyps)
    result = run.score(test, hyps, words=True)
    with atomic_write(target / "score.txt") as f:
        f.write(format_summary(result) + "\n")
    return result, rtf


def _lm_table(run: LMRun, dev: str, tests: list[str],
              rows: list[tuple[str, Any, list[tuple[Any, float]]]]) -> str:
    metric = "CER" if run.unit == "char" else "WER"
    lines = [f"# Results of {run.plan.exp_dir} with language models", "",
             f"Model: `{run.checkpoint}`; beam {run.options.beam_size}; weights chosen on "
             f"`{dev}` (`{LM_DIR_NAME}/<setting>/weights.json`).", "",
             *(["A phone model: rows without TLG are its phone error rate (%PER).", ""]
               if run.plan.hyper.get("tokenizer", {}).get("type") == "lexicon" else []),
             "| setting | weights | " + " | ".join(f"{set_name(t)} %{metric} | RTF"
                                                  for t in tests) + " |",
             "|---|---|" + "---:|---:|" * len(tests)]
    for name, weights, results in rows:
        described = "-"
        if weights:
            parts = []
            if weights.get("wfst"):
                parts.append("TLG " + ", ".join(f"{k} {v:g}" for k, v in weights["wfst"].items()))
            if weights.get("fusion"):
                parts.append("fusion " + ", ".join(f"{k} {v:g}"
                                                   for k, v in weights["fusion"].items()))
            if weights.get("rescore"):
                parts.append("rescore " + ", ".join(f"{k} {v:g}"
                                                    for k, v in weights["rescore"].items()))
            described = "; ".join(parts)
        cells = " | ".join(f"{r.error_rate:.2f} | {rtf:.4f}" for r, rtf in results)
        lines.append(f"| {name} | {described} | {cells} |")
    return "\n".join(lines) + "\n"
