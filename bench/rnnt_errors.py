"""Where an RNN-T model's errors come from: its searches against its own auxiliary CTC head,
on held-out and on training utterances, with the deletions sorted by where they fall.

    python bench/rnnt_errors.py EXP CKPT [CKPT ...] --data data/fbank/test \
        --data data/fbank/train_sp:400 [--beam 4] [--blank-penalty 0 0.5 1.0] [--out FILE]

The checkpoints are averaged (as stage 4 averages them). `DIR:N` scores the first N
utterances of a data dir (original-speed keys only for a speed-perturbed one). Each row:
%CER with its substitutions / deletions / insertions, and the deletions inside a run of a
repeated character (`走走` -> `走`), of the last character, and elsewhere. Searches: RNN-T
greedy and modified beam search (each blank penalty, sherpa-onnx's `blank_penalty`: a
constant taken from the blank logit), and, when the model has one, the auxiliary CTC head's
greedy output: the encoder read out by CTC. A CTC head far better than the transducer
on the same encoder puts the gap in the predictor and joiner; both poor on held-out data
but good on training data is overfitting; poor on both is too little training.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import kaldiio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.core.io import read_table
from cat.decoding.checkpoint import averaged_checkpoint
from cat.decoding.searcher import load_model
from cat.scoring import align, tokenize


def read_set(spec: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """`DIR` or `DIR:N` -> (name, feats.scp entries, transcripts) of the chosen keys."""
    directory, _, count = spec.partition(":")
    scp = read_table(Path(directory) / "feats.scp")
    text = read_table(Path(directory) / "text", allow_empty_value=True)
    keys = [key for key in scp if key in text and not key.startswith("sp")]
    if count:
        keys = keys[:int(count)]
    return spec, {key: scp[key] for key in keys}, {key: text[key] for key in keys}


def error_kinds(refs: dict[str, str], hyps: dict[str, str]) -> dict[str, float]:
    """%CER, S/D/I and where the deletions fall."""
    counts = dict(ref=0, sub=0, del_=0, ins=0, del_repeat=0, del_last=0)
    for key, ref_text in refs.items():
        ref, hyp = tokenize(ref_text), tokenize(hyps.get(key, ""))
        alignment = align(ref, hyp)
        counts["ref"] += len(ref)
        position = -1
        for op, unit in zip(alignment.ops, alignment.ref, strict=True):
            if unit is not None:
                position += 1
            if op == "S":
                counts["sub"] += 1
            elif op == "I":
                counts["ins"] += 1
            elif op == "D":
                counts["del_"] += 1
                repeated = ((position > 0 and ref[position - 1] == unit)
                            or (position + 1 < len(ref) and ref[position + 1] == unit))
                if repeated:
                    counts["del_repeat"] += 1
                elif position == len(ref) - 1:
                    counts["del_last"] += 1
    errors = counts["sub"] + counts["del_"] + counts["ins"]
    return {"cer": round(100.0 * errors / max(counts["ref"], 1), 2), "errors": errors,
            "ref": counts["ref"], "sub": counts["sub"], "del": counts["del_"],
            "ins": counts["ins"], "del_repeat": counts["del_repeat"],
            "del_last": counts["del_last"],
            "del_other": counts["del_"] - counts["del_repeat"] - counts["del_last"]}


def decode_set(model, tokenizer, scp: dict[str, str], beam: int, penalties: list[float],
               batch_size: int = 32) -> dict[str, dict[str, str]]:
    """Hypotheses of every search for the utterances of `scp`."""
    features = {key: torch.from_numpy(kaldiio.load_mat(path).copy()) for key, path in scp.items()}
    keys = sorted(features, key=lambda key: features[key].shape[0])
    hyps: dict[str, dict[str, str]] = {}

    def put(search: str, key: str, tokens: list[int]) -> None:
        hyps.setdefault(search, {})[key] = tokenizer.decode(tokens)

    with torch.no_grad():
        for start in range(0, len(keys), batch_size):
            batch = keys[start:start + batch_size]
            lens = torch.tensor([features[key].shape[0] for key in batch])
            feats = torch.nn.utils.rnn.pad_sequence([features[key] for key in batch],
                                                    batch_first=True)
            encoder_out, lengths = model.encoder(feats, lens)
            for penalty in penalties:
                greedy = model.transducer.search(encoder_out, lengths, "greedy", beam,
                                                 blank_penalty=penalty)
                nbest = model.transducer.nbest(encoder_out, lengths, beam, blank_penalty=penalty)
                for key, tokens, lists in zip(batch, greedy, nbest, strict=True):
                    put(f"rnnt greedy, blank penalty {penalty}", key, tokens)
                    put(f"rnnt beam {beam}, blank penalty {penalty}", key,
                        lists[0][0] if lists else [])
            if "ctc" in model.head_names:
                greedy = model.ctc.search(encoder_out, lengths, "greedy", beam)
                for key, tokens in zip(batch, greedy, strict=True):
                    put("auxiliary CTC head, greedy", key, tokens)
    return hyps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exp")
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--data", action="append", required=True)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--blank-penalty", type=float, nargs="+", default=[0.0])
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "avg.pt"
        torch.save(averaged_checkpoint(args.checkpoints), checkpoint)
        model, tokenizer = load_model(args.exp, checkpoint, torch.device("cpu"),
                                      allow_config_change=True)
    rows = []
    for spec in args.data:
        name, scp, refs = read_set(spec)
        for search, hyps in decode_set(model, tokenizer, scp, args.beam,
                                       args.blank_penalty).items():
            rows.append({"set": name, "search": search, **error_kinds(refs, hyps)})
    print("| set | search | %CER | sub | del | ins | del in repeats | del last | del other |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['set']} | {row['search']} | {row['cer']:.2f} ({row['errors']} / "
              f"{row['ref']}) | {row['sub']} | {row['del']} | {row['ins']} | "
              f"{row['del_repeat']} | {row['del_last']} | {row['del_other']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"checkpoints": args.checkpoints, "rows": rows},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
