"""Tiny end-to-end runs of both recipes through every stage, as a user runs them.

Each recipe is copied into a scratch tree (with `path.sh` and `utils/` linked from the
checkout) and run with `--synthetic true`, a corpus of a few dozen utterances and the
`exp/tiny-ctc` experiment: generation, preparation, features, packing (map-style for
AISHELL-1, tar shards for WenetSpeech), a few training steps, decoding and scoring.
"""

import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import kaldiio
import pytest

from cat.formats.mappack import MapPack
from cat.formats.shard_check import validate
from cat.graph.denominator import load_den_graph
from cat.text.lexicon import read_lexicon

ROOT = Path(__file__).resolve().parents[2]
CER_LINE = re.compile(r"^\| (\w+) \| ([0-9.]+) \| (\d+) / (\d+) \|", re.MULTILINE)


def _recipe_copy(tmp_path: Path, corpus: str) -> Path:
    for name in ("path.sh", "utils"):
        (tmp_path / name).symlink_to(ROOT / name)
    recipe = tmp_path / "egs" / corpus
    recipe.mkdir(parents=True)
    for name in ("run.sh", "cmd.sh"):
        shutil.copy(ROOT / "egs" / corpus / name, recipe)
    shutil.copytree(ROOT / "egs" / corpus / "local", recipe / "local")
    for exp in (ROOT / "egs" / corpus / "exp").glob("tiny-*"):
        shutil.copytree(exp, recipe / "exp" / exp.name,
                        ignore=shutil.ignore_patterns("*.arpa", "*.done", "train.json"))
    return recipe


def _run(recipe: Path, *args: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST")}
    proc = subprocess.run(["bash", "run.sh", *args], cwd=recipe, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def _results(recipe: Path) -> dict[str, tuple[float, int, int]]:
    table = (recipe / "exp/tiny-ctc/RESULTS.md").read_text(encoding="utf-8")
    return {m[1]: (float(m[2]), int(m[3]), int(m[4])) for m in CER_LINE.finditer(table)}


def _lm_results(recipe: Path) -> dict[str, list[float]]:
    """{setting: [%CER per test set]} from RESULTS-lm.md."""
    rows = {}
    for line in (recipe / "exp/tiny-ctc/RESULTS-lm.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 2 and re.fullmatch(r"[0-9.]+", cells[2]):
            rows[cells[0]] = [float(c) for c in cells[2::2]]
    return rows


@pytest.mark.slow
def test_aishell_recipe_runs_every_stage(tmp_path):
    recipe = _recipe_copy(tmp_path, "aishell")
    args = ("--synthetic", "true", "--synthetic_utts", "60", "--lm_sentences", "300",
            "--exp", "exp/tiny-ctc")
    log = _run(recipe, *args)
    for stage in range(6):
        assert f"Stage {stage}:" in log
    # stage 0: the release layout parsed into Kaldi data dirs, missing transcripts reported
    meta = json.loads((recipe / "corpus/synthetic/synthetic.json").read_text(encoding="utf-8"))
    prepared = {part: len((recipe / "data" / part / "text").read_text().splitlines())
                for part in ("train", "dev", "test")}
    assert sum(prepared.values()) == 60 - len(meta["audio_without_transcript"])
    # stage 1: features with speed perturbation, readable by kaldiio
    feats = kaldiio.load_scp(str(recipe / "data/fbank/train_sp/feats.scp"))
    assert len(feats) == 3 * prepared["train"]
    assert any(key.startswith("sp0.9-") for key in feats)
    # stage 2: tokenizer and map-style packs
    pack = MapPack(recipe / "exp/tiny-ctc/pack/train.npz")
    assert len(pack) == 3 * prepared["train"]
    # stage 3: checkpoints; stage 4: every test set decoded and scored
    assert list((recipe / "exp/tiny-ctc/check").glob("ckpt-*.pt"))
    results = _results(recipe)
    assert set(results) == {"dev", "test"}
    for name, (_, _, total) in results.items():
        reference = (recipe / "data/fbank" / name / "text").read_text(encoding="utf-8")
        assert total == sum(len(line.split(maxsplit=1)[1]) for line in reference.splitlines())
    # stage 5: LM text disjoint from the corpus, LMs trained, weights chosen on dev from
    # the configured grid, every test set decoded with each setting
    lm_text = (recipe / "data/lm_text/text").read_text(encoding="utf-8").splitlines()
    corpus = {line.split(maxsplit=1)[1] for part in ("train", "dev", "test")
              for line in (recipe / "data" / part / "text").read_text().splitlines()}
    assert len(lm_text) == 300 and not corpus & {line.split()[1] for line in lm_text}
    for lm in ("tiny-lm-char-3gram", "tiny-lm-word-2gram"):
        assert (recipe / "exp" / lm / "lm.arpa").read_text(encoding="utf-8").startswith("\\data")
    lm_results = _lm_results(recipe)
    assert set(lm_results) == {"none", "char-3gram", "word-2gram"}
    assert all(len(cers) == 2 for cers in lm_results.values())
    fusion = json.loads((recipe / "exp/tiny-ctc/decode-lm/char-3gram/weights.json").read_text())
    assert fusion["fusion"]["alpha"] in (0.3, 0.6) and fusion["fusion"]["beta"] == 0.5
    assert len(fusion["fusion_grid"]) == 2 and fusion["rescore"] is None
    rescore = json.loads((recipe / "exp/tiny-ctc/decode-lm/word-2gram/weights.json").read_text())
    assert len(rescore["rescore_grid"]) == 4 and rescore["fusion"] is None
    assert min(g["error_rate"] for g in rescore["rescore_grid"]) == rescore["dev_error_rate"]
    nbest = (recipe / "exp/tiny-ctc/decode-lm/first-pass/test/nolm/nbest.jsonl").read_text()
    assert len(nbest.splitlines()) == prepared["test"]
    # a re-run finds every stage done and changes nothing
    results_table = (recipe / "exp/tiny-ctc/RESULTS.md").read_text(encoding="utf-8")
    lm_table = (recipe / "exp/tiny-ctc/RESULTS-lm.md").read_text(encoding="utf-8")
    checkpoints = {p: p.stat().st_mtime_ns for p in (recipe / "exp/tiny-ctc/check").iterdir()}
    rerun = _run(recipe, *args)
    assert "already prepared" in rerun and "already extracted" in rerun
    assert "already trained" in rerun
    assert "lm.arpa is up to date" in rerun and "already generated" in rerun
    assert (recipe / "exp/tiny-ctc/RESULTS.md").read_text(encoding="utf-8") == results_table
    assert (recipe / "exp/tiny-ctc/RESULTS-lm.md").read_text(encoding="utf-8") == lm_table
    assert checkpoints == {p: p.stat().st_mtime_ns
                           for p in (recipe / "exp/tiny-ctc/check").iterdir()}
    # CTC-CRF on the same data, stages 2-5 (exp/tiny-crf): the release's lexicon, phone
    # units, the denominator graph, training with the CRF loss, TLG decoding with the word LM
    crf_args = [a if a != "exp/tiny-ctc" else "exp/tiny-crf" for a in args]
    crf_log = _run(recipe, *crf_args, "--stage", "2")
    assert "denominator graph exp/tiny-crf/den_lm.npz" in crf_log
    lexicon = read_lexicon(recipe / "data/local/lexicon.txt")
    graph = load_den_graph(recipe / "exp/tiny-crf/den_lm.npz")
    assert graph.info["order"] == 2 and graph.info["left_out_unk"] == 0
    assert graph.num_classes == 2 + len({p for ps in lexicon.values() for p in ps})
    assert "%PER" in (recipe / "exp/tiny-crf/RESULTS.md").read_text(encoding="utf-8")
    tlg = json.loads((recipe / "exp/tiny-crf/decode-lm/word-2gram-tlg/weights.json").read_text())
    assert [g["lm_weight"] for g in tlg["wfst_grid"]] == [0.5, 1.0]
    crf_rows = (recipe / "exp/tiny-crf/RESULTS-lm.md").read_text(encoding="utf-8")
    assert "| word-2gram-tlg | TLG lm_weight" in crf_rows


@pytest.mark.slow
def test_wenetspeech_recipe_streams_audio_shards_through_every_stage(tmp_path):
    recipe = _recipe_copy(tmp_path, "wenetspeech")
    # A corpus needs no packer of its own: stage 2 runs the library's.
    (recipe / "local" / "prep_wds.py").unlink()
    output = _run(recipe, "--synthetic", "true", "--synthetic_hours", "0.06",
                  "--exp", "exp/tiny-ctc")
    # segments cut from the long Opus recordings
    assert (recipe / "data/train_l/segments").is_file()
    # the training set is packed as audio: stage 1 computes no features for it
    assert "data/fbank/train_l: not read by exp/tiny-ctc" in output
    assert not (recipe / "data/fbank/train_l").exists()
    # opus shards in two length groups, each with an index that validates
    shards = recipe / "data/wds/train_l_opus"
    groups = sorted(p.name for p in shards.iterdir() if p.is_dir())
    assert groups == ["10_300", "300_2000"]
    for group in groups:
        assert validate(shards / group) == []
        header = json.loads((shards / group / "index.jsonl").read_text().splitlines()[0])
        assert header["content"] == "audio" and header["audio_format"] == "opus"
        with tarfile.open(next((shards / group).glob("data-*.tar"))) as tar:
            assert {name.rpartition(".")[2] for name in tar.getnames()} == {"opus", "txt"}
    # training streamed the shards: the epoch summary accounts for every utterance
    num_train = len((recipe / "data/train_l/text").read_text(encoding="utf-8").splitlines())
    summary = json.loads((recipe / "exp/tiny-ctc/log/epoch-001.json").read_text())
    (rank,) = summary["ranks"]
    dropped_in_packing = len((shards / "dropped.txt").read_text().splitlines()) \
        if (shards / "dropped.txt").exists() else 0
    assert rank["expected"] + dropped_in_packing == num_train and rank["not_trained"] == 0
    assert rank["trained"] + sum(rank["dropped"].values()) == rank["expected"]
    coverage = json.loads((recipe / "exp/tiny-ctc/log/coverage.jsonl").read_text()
                          .splitlines()[0])
    assert coverage["epoch"] == 1 and coverage["trained"] == rank["trained"]
    results = _results(recipe)
    assert set(results) == {"dev", "test_net", "test_meeting"}


@pytest.mark.parametrize("corpus", ["aishell", "wenetspeech"])
def test_run_sh_help_from_the_repository_root_lists_every_option_with_its_default(corpus):
    proc = subprocess.run(["bash", f"egs/{corpus}/run.sh", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "can't read" not in proc.stderr
    text = proc.stdout
    assert "Usage:" in text  # the header
    options = dict(re.findall(r"^  --(\w+) +(\S+)", text, re.MULTILINE))
    assert options["stage"] == "0" and options["stop_stage"] == "5"
    assert options["nj"] == "2" and options["synthetic"] == "false"
    # utils/asr.sh's own options, passed on: listed with their defaults.
    assert "passed on to ../../utils/asr.sh" in text
    assert options["test_sets"] == "dev" and options["local_data_opts"] == '""'


def test_the_recipes_share_one_shard_packer():
    """Each recipe's `local/prep_wds.py` (the large-dataset design's name for the packer) is a
    link to the one in utils/, and the shared stages run the library's packer."""
    for corpus in ("aishell", "wenetspeech"):
        local = ROOT / "egs" / corpus / "local" / "prep_wds.py"
        assert local.is_symlink() and local.resolve() == ROOT / "utils" / "prep_wds.py"
    stages = (ROOT / "utils" / "asr.sh").read_text(encoding="utf-8")
    assert "python -m cat.formats.prep_wds pack-exp" in stages and "prep_wds.py" not in stages


def test_recipe_passes_further_options_on_to_the_shared_stages(tmp_path):
    recipe = _recipe_copy(tmp_path, "aishell")
    log = _run(recipe, "--test_sets", "test", "--train_set=train2", "--stage", "9",
               "--stop_stage", "9", "--exp", "exp/tiny-ctc")
    assert "train_set=train2 test_sets='test'" in log
    proc = subprocess.run(["bash", "run.sh", "--no_such_option", "1"], cwd=recipe,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "unknown option --no_such_option" in proc.stderr
