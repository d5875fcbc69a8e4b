"""Entry points: `klppo train` (with the quickstart and the `--dry-run` plan), `klppo export` and
`klppo tune`. Argument parsing, launching and exit codes; everything else is imported from below."""
