"""The recipes' stages 2-5 for one experiment, as its `hyper-p.json` says:
`python -m cat.stages.driver prepare|train|decode|lm EXP`.

`driver` (the command; stages 2-4), `lm` (stage 5: language models), `plan` (what the
stages read of an experiment: its hyper-p.json, data and the model to decode).
"""
