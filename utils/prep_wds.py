#!/usr/bin/env python3
"""The recipes' tar-shard packer, `python -m cat.formats.prep_wds` under the name the
large-dataset design gives it: each recipe's `local/prep_wds.py` is a link to this file.

`pack-exp` packs what an experiment streams, as its hyper-p.json `data.shards` says
(the one place its length groups come from; audio shards with `data.shards.audio`);
`pack` (features), `pack-audio` (a data dir's audio) and `validate` work on any
feature or data directory and shard folder; `index` indexes shards other tools wrote.

The interface of the large-dataset design is importable from here, as it describes it:
`UTTS_PER_FILE` (utterances per tar file) and
`pack_data(f_scps, f_labels, d_out, fmt="data-%05d.tar", filter_group=None)`
(`cat.formats.prep_wds.pack_data`, which also takes `utts_per_file`, `num_jobs`, `dtype`
and `seed` as keywords).

Usage:
    python local/prep_wds.py pack-exp exp/synth-ctc --nj 4
    python local/prep_wds.py validate data/wds/train/10_1000
    python -c 'from prep_wds import pack_data; pack_data("feats.scp", "text", "wds")'  # in local/
"""

import sys
from pathlib import Path

try:
    import cat  # noqa: F401  (on the path once path.sh is sourced)
except ImportError:  # imported from local/ without path.sh: the checkout holding utils/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cat.formats.prep_wds import UTTS_PER_FILE, main, pack_data

__all__ = ["UTTS_PER_FILE", "main", "pack_data"]

if __name__ == "__main__":
    main()
