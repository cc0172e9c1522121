"""Usage: python -m cat.migrate OLD_EXP NEW_EXP [--metainfo data/metainfo.json] [--force]"""

from cat.migrate.experiment import cli

cli()
