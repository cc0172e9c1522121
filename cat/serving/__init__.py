"""A trained experiment, or its export, as a service: `python -m cat.serve EXP` (see
`cat.serving.server`)."""
