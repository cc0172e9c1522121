"""A CAT v3 experiment turned into this toolkit's: `python -m cat.migrate OLD_EXP NEW_EXP`.

`experiment` (the command, `migrate`, the report), `hyper` (hyper-p.json), `config`
(config.json), `record` (what became of each key).
"""
