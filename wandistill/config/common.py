"""What the recipe's sections share: the allowed dtypes and backends, and how a section reports
every failed check at once and checks its locations through the CLI's one parser."""

from __future__ import annotations

from wandistill.errors import ConfigError

DTYPES = ("fp32", "fp16", "bf16")
BACKENDS = ("webdataset", "zarr")


def _locations(**given: tuple[str, bool]) -> tuple[bool, str]:
    """The recipe's locations (key -> (value, URL supported)) through the CLI's one parser
    (`wandistill.io.location`): a URL only where the stage reads or writes it end to end, never
    a local path named like a URL. A (passed, message) check for `_problems`."""
    from wandistill.io.location import problem

    bad = [p for k, (v, url) in given.items() if (p := problem(v, k, url=url))]
    return not bad, "; ".join(bad)


def _problems(*checks: tuple[bool, str]) -> None:
    """Raise once with every failed check, so a user fixes a recipe in one pass."""
    bad = [msg for ok, msg in checks if not ok]
    if bad:
        raise ConfigError("; ".join(bad))
