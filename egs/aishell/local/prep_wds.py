"""Pack AISHELL-1 features into webdataset tar shards (the large-dataset path on AISHELL).

The CLI of `python -m cat.data.prep_wds`; `UTTS_PER_FILE` and `pack_data` are
importable from here too.

Usage:
    python local/prep_wds.py pack --scp data/train_sp/feats.scp --text data/train_sp/text \
        --out data/wds/train_sp --nj 4
    python local/prep_wds.py validate data/wds/train_sp/10_2000
"""

from cat.data.prep_wds import UTTS_PER_FILE, main, pack_data

__all__ = ["FILTER_GROUP", "UTTS_PER_FILE", "pack_data"]

# AISHELL-1 utterances last 1-15 s, so one group holds them all; it drops only
# fragments under 0.1 s, too short for 4x subsampling.
FILTER_GROUP = ("10:2000",)

if __name__ == "__main__":
    main(default_filter_group=FILTER_GROUP)
