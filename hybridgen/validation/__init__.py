"""Checks of user input shared by every entry point: numbers (:mod:`.numbers`), paths
(:mod:`.paths`). Each refusal is a one-line :class:`hybridgen.errors.ConfigError` naming the field."""
