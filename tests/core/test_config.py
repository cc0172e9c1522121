"""hyper-p.json / config.json loading: schema, unknown keys, defaults, resolved copy."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import jsonschema
import pytest

import cat
from cat.core import config
from cat.core.config import ConfigError
from cat.testing.training import tiny_model_config


def _write_exp(tmp_path, hyper: dict, model: dict | None = None):
    exp = tmp_path / "exp" / "asr"
    exp.mkdir(parents=True)
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    (exp / "config.json").write_text(json.dumps(model or tiny_model_config()), encoding="utf-8")
    return exp


def _hyper(**option) -> dict:
    return {
        "data": {"train": ["data/fbank/train_sp"], "dev": "data/fbank/dev",
                 "test": ["data/fbank/dev", "data/fbank/test"], "filter": "10:2000"},
        "tokenizer": {"type": "sentencepiece",
                      "option-train": {"model_type": "char", "vocab_size": 0},
                      "file": "exp/asr/tokenizer.tknz"},
        "env": {"OMP_NUM_THREADS": "2"},
        "train": {"bin": "cat.ctc.train", "option": option},
        "inference": {"avgmodel": {"mode": "best", "num": 5},
                      "infer": {"bin": "cat.ctc.decode", "option": {"beam_size": 8, "any": 1}},
                      "er": {"cer": True}},
    }


def test_schema_is_valid_and_the_options_dataclass_is_derived_from_it():
    schema = config.load_hyper_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    properties = schema["$defs"]["trainOption"]["properties"]
    fields = {f.name: f for f in dataclasses.fields(config.TrainOptions)}
    assert list(fields) == list(properties)
    options = config.TrainOptions()
    python_types = {"boolean": bool, "integer": int, "number": float}
    for key, spec in properties.items():
        assert "default" in spec and spec.get("description"), key
        assert getattr(options, key) == spec["default"], key
        if isinstance(spec.get("type"), str) and spec["type"] in python_types:
            assert fields[key].type is python_types[spec["type"]], key
    assert fields["trset"].type == str | list | None
    # Mutable defaults are copies: one instance cannot change another's.
    assert config.TrainOptions().audio is None
    assert config.TrainOptions.__module__ == "cat.core.config"


def test_an_option_added_to_the_schema_needs_nothing_else(tmp_path, monkeypatch):
    schema = config.load_hyper_schema()
    schema["$defs"]["trainOption"]["properties"]["new_option"] = {
        "type": "array", "items": {"type": "integer"}, "default": [1, 2],
        "description": "an option only the schema defines"}
    monkeypatch.setattr(config, "load_hyper_schema", lambda: schema)
    config.train_options_class.cache_clear()
    try:
        assert config.TrainOptions().new_option == [1, 2]
        exp = _write_exp(tmp_path, _hyper(new_option=[3]))
        assert config.load_experiment(exp).options.new_option == [3]
        exp = _write_exp(tmp_path / "2", _hyper(new_option=["x"]))
        with pytest.raises(ConfigError, match=r"train.option.new_option\[0\]: 'x' is not of "):
            config.load_experiment(exp)
        del schema["$defs"]["trainOption"]["properties"]["new_option"]["default"]
        with pytest.raises(ConfigError, match="trainOption: new_option without a 'default'"):
            config.options_class(schema)
    finally:
        monkeypatch.undo()
        config.train_options_class.cache_clear()
    assert not hasattr(config.TrainOptions(), "new_option")


def _undescribed(schema: dict) -> list[str]:
    """Paths of properties without a description (directly or through their $ref)."""
    definitions = schema.get("$defs", {})

    def described(spec: dict) -> bool:
        if "description" in spec:
            return True
        ref = spec.get("$ref", "")
        return bool(ref) and described(definitions[ref.rsplit("/", 1)[-1]])

    missing = []

    def walk(node, path: str) -> None:
        if isinstance(node, list):
            for index, item in enumerate(node):
                walk(item, f"{path}[{index}]")
        if not isinstance(node, dict):
            return
        for key, spec in node.get("properties", {}).items():
            if isinstance(spec, dict) and not described(spec):
                missing.append(f"{path}.{key}")
        for key, child in node.items():
            # Conditional subschemas restate keys described where they are defined.
            if key not in ("if", "then", "else", "not"):
                walk(child, f"{path}/{key}")

    walk(schema, "")
    return missing


@pytest.mark.parametrize("path", [config.HYPER_SCHEMA_PATH, config.CONFIG_SCHEMA_PATH,
                                  Path(cat.__file__).parent / "lm" / "schemas" / "lm.schema.json"])
def test_every_schema_key_has_a_description_for_editors(path):
    assert _undescribed(json.loads(path.read_text(encoding="utf-8"))) == []


#: Integer keys that are no size (seeds, counts of updates, epochs, steps, retries): they
#: allocate nothing, so they need no maximum.
NOT_SIZES = {"seed", "epochs", "max_steps", "check_freq", "log_interval", "read_retries",
             "min_count", "warmup_steps", "stop_step", "start_batch"}


def _unbounded_sizes(schema: dict) -> list[str]:
    """Integer keys (sizes) of a schema without a maximum, by path."""
    definitions = schema.get("$defs", {})
    found = []

    def integer(spec: dict) -> dict | None:
        if "$ref" in spec:
            target = definitions[spec["$ref"].rsplit("/", 1)[-1]]
            return {**target, **{k: v for k, v in spec.items() if k != "$ref"}} \
                if integer(target) is not None else None
        kinds = spec.get("type")
        return spec if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds) \
            else None

    def walk(node: object, path: str) -> None:
        if isinstance(node, list):
            for index, item in enumerate(node):
                walk(item, f"{path}[{index}]")
        if not isinstance(node, dict):
            return
        for key, spec in node.get("properties", {}).items():
            if isinstance(spec, dict) and key not in NOT_SIZES:
                bounded = integer(spec)
                if bounded is not None and "maximum" not in bounded:
                    found.append(f"{path}.{key}")
        for key, child in node.items():
            walk(child, f"{path}/{key}")

    walk(schema, "")
    return found


@pytest.mark.parametrize("name", ["hyper-p", "config", "lm", "decoding options"])
def test_every_size_key_has_a_maximum(name):
    """A mistyped size (CUSIDE's trainer.chunk_size 10^9 padded every batch to a chunk of
    6 GB) is refused by name, with the key and the bound, before anything is allocated."""
    from cat.decoding.searcher import ACCEPT_SCHEMA, options_schema

    schemas = {"hyper-p": config.HYPER_SCHEMA_PATH, "config": config.CONFIG_SCHEMA_PATH,
               "lm": Path(cat.__file__).parent / "lm" / "schemas" / "lm.schema.json"}
    decoding = options_schema()
    schema = ({**decoding, "properties": {**decoding["properties"], **ACCEPT_SCHEMA}}
              if name == "decoding options" else
              json.loads(schemas[name].read_text(encoding="utf-8")))
    assert _unbounded_sizes(schema) == []


def test_a_size_past_its_maximum_is_named(tmp_path):
    model = tiny_model_config()
    model["encoder"]["kwargs"]["max_chunk_size"] = 0
    model["trainer"] = {"chunk_size": 10**9}
    exp = _write_exp(tmp_path, _hyper(), model)
    with pytest.raises(ConfigError, match=r"config\.json: trainer\.chunk_size: 1000000000 is "
                                          r"greater than the maximum of 10000"):
        config.load_experiment(exp)
    hyper = _hyper()
    hyper["train"]["option"]["shuffle_buffer"] = 10**12
    exp = _write_exp(tmp_path / "2", hyper)
    with pytest.raises(ConfigError, match=r"train\.option\.shuffle_buffer: 1000000000000 is "
                                          r"greater than the maximum of 10000000"):
        config.load_experiment(exp)


def test_editor_settings_map_experiment_files_to_the_schemas():
    root = Path(cat.__file__).parent.parent
    settings = json.loads((root / ".vscode" / "settings.json").read_text(encoding="utf-8"))
    mapped = {entry["url"]: entry["fileMatch"] for entry in settings["json.schemas"]}
    assert mapped == {"./cat/core/schemas/hyper-p.schema.json": ["egs/*/exp/**/hyper-p.json"],
                      "./cat/core/schemas/config.schema.json": ["egs/*/exp/**/config.json"],
                      "./cat/lm/schemas/lm.schema.json": ["egs/*/exp/**/lm.json"]}
    for url, patterns in mapped.items():
        schema = json.loads((root / url).read_text(encoding="utf-8"))
        files = [path for pattern in patterns for path in sorted(root.glob(pattern))]
        assert files, patterns
        for path in files:
            # What an editor checks while a file is edited: the file against its schema.
            config.check_against_schema(json.loads(path.read_text(encoding="utf-8")), schema,
                                        str(path))


def test_defaults_and_placeholders_are_resolved(tmp_path):
    exp = _write_exp(tmp_path, _hyper(batch_size=16))
    experiment = config.load_experiment(exp)
    options = experiment.options
    assert options.batch_size == 16
    assert options.trset == [str(exp / "pack" / "train.npz")]
    assert options.devset == [str(exp / "pack" / "dev.npz")]
    assert options.tokenizer == "exp/asr/tokenizer.tknz"
    assert options.filter == "10:2000"
    assert options.large_dataset is False and options.shuffle_buffer == 3000
    assert experiment.hyper["train"]["option"]["max_frames"] == 20000
    assert experiment.config["encoder"]["type"] == "ConformerNet"


def test_large_dataset_options(tmp_path):
    pattern = "data/wds/train/{10_1000,1000_2000}/data-*.tar"
    exp = _write_exp(tmp_path, _hyper(large_dataset=True, trset=pattern,
                                      tokenizer="other.tknz", filter="10:1000"))
    options = config.load_experiment(exp).options
    assert (options.trset, options.tokenizer, options.filter) == \
        ([pattern], "other.tknz", "10:1000")


@pytest.mark.parametrize(("hyper_change", "message"), [
    (lambda h: h["train"]["option"].update({"large-dataset": True}),
     r"hyper-p.json: train.option: unknown key 'large-dataset' \(did you mean "
     r"'large_dataset'\?\); allowed keys: amp, amp_dtype, audio, bad_shard_limit, batch_size, "
     r"buckets, check_freq, compile"),
    (lambda h: h.update(commit="abc"), r"hyper-p.json: \(top level\): unknown key 'commit'"),
    (lambda h: h["inference"]["avgmodel"].update(nbest=3),
     r"inference.avgmodel: unknown key 'nbest'; allowed keys: mode, num"),
    (lambda h: h["inference"]["er"].update(oracle=True), r"inference.er: unknown key 'oracle'"),
    (lambda h: h["data"].update(dtrain=["x"]), r"data: unknown key 'dtrain'"),
    (lambda h: h["train"]["option"].update(batch_size="64"),
     r"train.option.batch_size: '64' is not of type 'integer'"),
    (lambda h: h["train"]["option"].update(grad_accum=0),
     r"train.option.grad_accum: 0 is less than the minimum of 1"),
    (lambda h: h["data"].update(filter="10-2000"), r"data.filter: '10-2000' does not match"),
    (lambda h: h["tokenizer"]["option-train"].update(min_count=2),
     r"tokenizer.option-train: 'min_count' should not be valid"),
    (lambda h: h["train"].update(bin="cat.lm.train"), r"train.bin: 'cat.lm.train' is not one of"),
    (lambda h: h.update(tokenizer={"type": "lexicon", "option-train": {"lexicon": "l.txt",
                                                                          "vocab_size": 9}}),
     r"tokenizer.option-train: 'vocab_size' is not one of \['lexicon'\]"),
    (lambda h: h.update(tokenizer={"type": "lexicon"}),
     r"tokenizer: 'option-train' is a required property"),
])
def test_bad_hyper_keys_are_named(tmp_path, hyper_change, message):
    hyper = _hyper()
    hyper_change(hyper)
    exp = _write_exp(tmp_path, hyper)
    with pytest.raises(ConfigError, match=message):
        config.load_experiment(exp)


def test_resolution_errors_name_the_key(tmp_path):
    exp = _write_exp(tmp_path, _hyper(large_dataset=True))
    with pytest.raises(ConfigError, match=r"train.option.trset: required when large_dataset"):
        config.load_experiment(exp)
    hyper = _hyper(trset=["a.npz", "b.npz"])
    exp = _write_exp(tmp_path / "2", hyper)
    with pytest.raises(ConfigError, match=r"train.option.trset: a map-style set is one pack"):
        config.load_experiment(exp)
    hyper = _hyper()
    del hyper["tokenizer"]["file"]
    exp = _write_exp(tmp_path / "3", hyper)
    with pytest.raises(ConfigError, match=r"train.option.tokenizer: not set, and "
                                          r"tokenizer.file is missing"):
        config.load_experiment(exp)
    exp = _write_exp(tmp_path / "4", {"data": {}})
    with pytest.raises(ConfigError, match=r"train: missing"):
        config.load_experiment(exp)


def test_invalid_json_and_bad_model_config_are_named(tmp_path):
    exp = _write_exp(tmp_path, _hyper())
    (exp / "hyper-p.json").write_text('{"train": {"bin": "cat.ctc.train",}}', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"hyper-p.json:1:\d+: invalid JSON"):
        config.load_experiment(exp)
    model = tiny_model_config()
    model["encoder"]["kwargs"]["hidden"] = 3
    exp = _write_exp(tmp_path / "2", _hyper(), model)
    with pytest.raises(ConfigError, match=r"config.json: encoder.kwargs: unknown key 'hidden'"):
        config.load_experiment(exp)
    with pytest.raises(FileNotFoundError, match=r"hyper-p.json does not exist"):
        config.load_experiment(tmp_path / "missing")


def test_resolved_copy_records_commit_and_env(tmp_path, monkeypatch):
    exp = _write_exp(tmp_path, _hyper())
    experiment = config.load_experiment(exp)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config.apply_env(experiment.hyper)
    assert os.environ["OMP_NUM_THREADS"] == "2"
    path = config.save_resolved(experiment, {"world_size": 1})
    document = json.loads(path.read_text(encoding="utf-8"))
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", document["commit"])
    assert document["hyper-p"]["train"]["option"]["batch_size"] == 64
    assert document["config"] == experiment.config and document["world_size"] == 1
    assert config.git_commit(tmp_path) == "unknown"


def _with_line_after(text: str, anchor: str, line: str) -> tuple[str, int, int]:
    """`text` with `line` inserted after the line holding `anchor`; (text, line number of
    the inserted line, line number of the anchor's)."""
    lines = text.splitlines()
    first = next(n for n, item in enumerate(lines, 1) if anchor in item)
    lines.insert(first, line)
    return "\n".join(lines) + "\n", first + 1, first


def test_duplicate_keys_in_hyper_p_json_are_named_with_their_line(tmp_path):
    exp = _write_exp(tmp_path, _hyper(epochs=1, seed=0))
    hyper_path = exp / "hyper-p.json"
    text, line, first = _with_line_after(json.dumps(_hyper(epochs=1, seed=0), indent=2),
                                         '"epochs": 1', '        "epochs": 3,')
    hyper_path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        config.load_experiment(exp)
    assert str(error.value) == (
        f"{hyper_path}:{line}: train.option: duplicate key 'epochs' (first on line "
        f"{first}); JSON keeps only the last: remove one")
    # A second "train" section would replace the first one whole.
    text = json.dumps(_hyper(epochs=1), indent=2)
    text = text[:-2] + ',\n  "train": {"bin": "cat.ctc.train", "option": {}}\n}\n'
    hyper_path.write_text(text, encoding="utf-8")
    train_line = text.count("\n", 0, text.index('\n  "train"')) + 2
    with pytest.raises(ConfigError, match=re.escape(
            f"hyper-p.json:{text.count(chr(10)) - 1}: (top level): duplicate key 'train' "
            f"(first on line {train_line})")):
        config.load_experiment(exp)


def test_duplicate_keys_in_config_json_are_named_with_their_line(tmp_path):
    exp = _write_exp(tmp_path, _hyper())
    text, line, first = _with_line_after(json.dumps(tiny_model_config(), indent=2),
                                         '"peak_lr": 0.003', '      "peak_lr": 30,')
    (exp / "config.json").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(
            f"config.json:{line}: scheduler.kwargs: duplicate key 'peak_lr' (first on line "
            f"{first})")):
        config.load_experiment(exp)
    with pytest.raises(ConfigError, match=re.escape(f"config.json:{line}: scheduler.kwargs")):
        config.load_config(exp / "config.json")


@pytest.mark.parametrize(("text", "line", "message"), [
    ('{"a": 1,\n "a": 2}', 2, "(top level): duplicate key 'a' (first on line 1)"),
    # Braces, commas, colons and escaped quotes inside strings are not structure.
    ('{"k": "a,{[\\"", "x": [{"k\\"": "}", "q": 1},\n {"q": 1,\n\n "q": 2}]}', 4,
     "x[1]: duplicate key 'q' (first on line 2)"),
    ('[1, {"a": {"b": [1, {"c": 0}]},\n "b": 2,\n "a": 3}]', 3,
     "[1]: duplicate key 'a' (first on line 1)"),
    ('{"s": {"t": 1, "u": {"t": 1}},\n "t": 1, "s": {}}', 2,
     "(top level): duplicate key 's' (first on line 1)"),
])
def test_duplicate_key_is_located_at_its_line(text, line, message):
    with pytest.raises(ConfigError) as error:
        config.parse_json(text, "x.json")
    assert str(error.value) == f"x.json:{line}: {message}; JSON keeps only the last: remove one"


def test_equal_keys_in_different_objects_are_not_duplicates():
    text = '{"a": {"b": 1}, "c": [{"b": 2}, {"b": 3}], "b": "a"}'
    assert config.parse_json(text, "x.json") == json.loads(text)
