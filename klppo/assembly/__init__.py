"""Building a run from its configuration: the one translation of verl keys into typed settings (shared by the
trainer, `--dry-run` and `klppo tune`), the startup checks, and the roles, engine and loaders those settings
describe. Knows nothing of the loop's order."""
