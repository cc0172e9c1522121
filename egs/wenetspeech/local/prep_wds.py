"""Pack WenetSpeech features into webdataset tar shards, one subfolder per length group.

The CLI of `python -m cat.data.prep_wds`, with WenetSpeech's length groups as the
default for `pack`; `UTTS_PER_FILE` and `pack_data` are importable from here too.

Usage:
    python local/prep_wds.py pack --scp data/train_l/feats.scp --text data/train_l/text \
        --out data/wds/train_l --nj 8
    python local/prep_wds.py validate data/wds/train_l/10_1000
"""

from cat.data.prep_wds import UTTS_PER_FILE, main, pack_data

__all__ = ["FILTER_GROUP", "UTTS_PER_FILE", "pack_data"]

# Segments run from under a second to tens of seconds. Shorter than 0.1 s is too short
# for 4x subsampling; the groups let `trset` globs pick lengths, e.g.
# data/wds/train_l/{10_1000,1000_2000}/data-*.tar leaves out segments over 20 s.
FILTER_GROUP = ("10:1000", "1000:2000", "2000:")

if __name__ == "__main__":
    main(default_filter_group=FILTER_GROUP)
