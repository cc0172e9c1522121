"""Former names of commands, kept for the scripts that run them (`python -m cat.utils.X`):
each module here only re-exports the module that now holds the command.

* `cat.utils.stage_driver` -> `cat.stages.driver` (the recipes' stages 2-5)
* `cat.utils.migrate` -> `cat.migrate` (a CAT v3 experiment turned into this toolkit's)
* `cat.utils.wer` -> `cat.scoring` (%WER / %CER; CAT's name)
* `cat.utils.avgmodel` -> `cat.decoding.avgmodel` (checkpoint averaging; CAT's name)

New code imports the modules they point to.
"""
