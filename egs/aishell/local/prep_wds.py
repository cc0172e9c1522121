"""The recipe's tar-shard packer: `python -m cat.formats.prep_wds` from the recipe directory.

`pack-exp` packs what an experiment streams, as its hyper-p.json `data.shards` says
(the one place its length groups come from; audio shards with `data.shards.audio`);
`pack` (features), `pack-audio` (a data dir's audio) and `validate` work on any
feature or data directory and shard folder; `index` indexes shards other tools wrote.

Usage:
    python local/prep_wds.py pack-exp exp/synth-ctc --nj 4
    python local/prep_wds.py validate data/wds/train/10_1000
"""

from cat.formats.prep_wds import main

if __name__ == "__main__":
    main()
